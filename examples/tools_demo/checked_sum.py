"""The README's example environment (section "Writing an environment"): the model may call
`add`, then answers; the answer is the reward. Run it on the tools demo with
`leangrpo train examples/tools_demo.yaml --set environment.name=examples/tools_demo/checked_sum.py:CheckedSum --set environment.tools=[] --set rewards.functions=[]`."""

from leangrpo.environments import Environment, ModelTurn, StepResult


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


class CheckedSum(Environment):
    """Answers tool calls with their results; the first turn without a call is the
    answer, worth 1.0 when it is the row's `answer` column."""

    tools = [add]
    replies = ("tool",)
    reward_terms = ("correct",)

    def reset(self, messages, row, seed):
        self.answer = str(row["answer"])
        return None  # start from the prompt's own messages

    def step(self, turn: ModelTurn) -> StepResult:
        if turn.calls or turn.parse_errors:
            return StepResult(reply=self.run_tools(turn))
        correct = float(turn.content.strip() == self.answer)
        return StepResult(done=True, rewards={"correct": correct}, metrics={"turns": turn.index + 1})
