"""The SmolLM2-135M-Instruct chat path with a tool (issue 22): trajectories sampled by the
real model through the bundled chatml-hermes template (its own ignores tools=) are the
engine's ids and the environment's segments, token for token: every model segment is the
engine's turn verbatim (sampled text need not re-encode to the same ids, so it is never
re-tokenised), every environment segment is the tokenisation of its own text, and the
decoded trajectory is the rendered conversation (less the closing after the last turn)."""

from __future__ import annotations

import pytest
import torch

from leangrpo.model.smollm2 import missing_reason

if missing_reason() is not None:
    pytest.skip(missing_reason(), allow_module_level=True)

from leangrpo.config.environment import EnvironmentConfig
from leangrpo.contracts import Prompt, SamplingParams
from leangrpo.data.templates import load_template
from leangrpo.environments.driver import MultiTurnRollout, TurnLimits
from leangrpo.environments.pool import EnvironmentPool
from leangrpo.environments.rendering import Renderer, check_template
from leangrpo.model.smollm2 import smollm2_dir
from leangrpo.rollout.hf.engine import HFEngine


class Recording:
    """The engine, keeping every turn its turn stream generated (seed -> completion)."""

    def __init__(self, engine):
        self.engine, self.turns = engine, {}

    @property
    def version(self):
        return self.engine.version

    def open_turns(self, params, version):
        stream = self.engine.open_turns(params, version)
        advance = stream.advance

        def recorded(timeout_s=0.0):
            done = advance(timeout_s)
            self.turns.update({r.seed: c for r, c in done})
            return done

        stream.advance = recorded
        return stream


def test_smollm2_trajectories_with_a_tool_are_token_exact():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with EnvironmentPool(EnvironmentConfig(name="support.environments:ToolReply", num_workers=1)) as pool:
        renderer = Renderer(tokenizer, pool.tools, load_template("chatml-hermes"))
        check_template(renderer, pool.replies, eos)
        engine = Recording(HFEngine(model, tokenizer))
        rollout = MultiTurnRollout(engine, pool, renderer, TurnLimits(2, 512), {eos})
        questions = ["What is 12 + 30? Use the add tool.", "Add 7 and 5."]
        prompts = [Prompt(i, q, [0], {}, [{"role": "user", "content": q}]) for i, q in enumerate(questions)]
        params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=5)
        completions = [c for g in rollout.generate(prompts, params, 2, 0) for c in g]
    assert '"name": "add"' in tokenizer.decode(completions[0].trajectory.start.ids)  # listed
    with_env = 0
    for c in completions:
        t = c.trajectory
        ids, pos = t.start.ids + c.ids, len(t.start.ids)
        for n, is_model in t.segments:
            segment = ids[pos : pos + n]
            if is_model:  # the engine's turn, verbatim
                assert any(segment == turn.ids for turn in engine.turns.values())
            else:  # the environment's: the tokenisation of its text
                with_env += 1
                text = tokenizer.decode(segment)
                assert tokenizer(text, add_special_tokens=False).input_ids == segment
                assert text.startswith("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>")
            pos += n
        rendered = renderer.render(t.messages, generation_prompt=False)
        decoded = tokenizer.decode(ids)
        closing = rendered[len(decoded) :]
        assert rendered.startswith(decoded) and closing in ("", "\n", "<|im_end|>\n")
    assert with_env >= 1, [c.finish_reason for c in completions]  # some turn ended on EOS
