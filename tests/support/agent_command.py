"""An agent as a command (agent.command): the task as JSON on stdin, the session from
OPENAI_BASE_URL and OPENAI_API_KEY, its reward terms printed as its last line."""

import json
import sys

import openai

task = json.load(sys.stdin)
r = openai.OpenAI(max_retries=0).chat.completions.create(model="policy", messages=task["messages"], max_tokens=4)
print(json.dumps({"tokens": float(r.usage.completion_tokens)}))
