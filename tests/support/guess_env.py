"""A classic verifiers environment for the adapter's tests: guess the sum; the environment
says higher or lower until it is right (needs verifiers >= 0.2, < 0.4)."""

import verifiers as vf
from datasets import Dataset


class Guess(vf.MultiTurnEnv):
    """Guess the sum: the environment says higher or lower until it is right."""

    async def env_response(self, messages, state, **kwargs):
        guess = (messages[-1].content or "").strip()
        target = int(state["answer"])
        if guess.isdigit() and int(guess) == target:
            state["solved"] = True
            return [vf.UserMessage(content="right")]
        hint = "higher" if guess.isdigit() and int(guess) < target else "lower"
        return [vf.UserMessage(content=hint)]

    @vf.stop
    async def solved(self, state) -> bool:
        return state.get("solved", False)


async def solved(state, **kwargs) -> float:
    return float(state.get("solved", False))


async def short(completion, **kwargs) -> float:
    return 1.0 / (1 + len(completion))


def load_environment(rows=8):
    data = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(395, 136), (548, 622)] * (rows // 2)]
    rubric = vf.Rubric(funcs=[solved, short], weights=[1.0, 0.0])
    return Guess(dataset=Dataset.from_list(data), rubric=rubric, max_turns=3)
