"""Tool schemas (environments/schema.py) are the ones `transformers.utils.get_json_schema`
makes, for every kind of hint and docstring it takes, and refused with one sentence where
it refuses; made without importing transformers (the start-up check must answer in < 2 s)."""

from __future__ import annotations

import subprocess
import sys
from enum import Enum
from typing import Any, Literal, Optional, Union

import pytest
from support.environments import add, undocumented
from transformers.utils import get_json_schema

from leangrpo.environments.schema import tool_schema
from leangrpo.environments.tools import ToolError


class Colour(Enum):
    RED = "red"
    BLUE = "blue"


class Level(Enum):
    LOW = 1
    HIGH = 2.5


def basics(a: int, b: float, c: str, d: bool, e: None, f: Any) -> str:
    """Every scalar.

    Some more words on a second paragraph.

    Args:
        a: An integer
            that goes on over a line.
        b (float): A float, its type in parentheses.
        c: A string (choices: ["x", "y"])
        d: A flag.
        e: Nothing.
        f: Anything.

    Returns:
        A string.

    Raises:
        ValueError: never.
    """
    return ""


def containers(
    a: list, b: list[int], c: tuple, d: tuple[int, str], e: dict, f: dict[str, list[float]]
) -> dict[str, int]:
    """Containers.

    Args:
        a: A bare list.
        b: Integers.
        c: A bare tuple.
        d: A pair.
        e: A bare dict.
        f: Lists by name.
    """
    return {}


def unions(
    a: int | None,
    b: Optional[str] = None,  # noqa: UP045  the typing spellings are what is tested
    c: Union[int, str] = 1,  # noqa: UP007
    d: int | list[int] = 0,
    e: Literal["a", 1, None] = "a",
    f: Colour = Colour.RED,
    g: Level = Level.LOW,
    h: list[int] | tuple = (),
):
    """Unions, literals, enums, defaults.

    Args:
        a: Maybe an int.
        b: Maybe a string.
        c: Either.
        d: One or many (choices: [1, 2, 3])
        e: A literal.
        f: A colour.
        g: A level.
        h: A mixed union.
    """


def returns_unconvertible(a: int) -> Colour | object:
    """A return hint without a schema is left out.

    Args:
        a: A number.
    """
    return Colour.RED


class Methods:
    def plain(self, x: int) -> int:
        """A method.

        Args:
            x: A number.
        """
        return x

    @classmethod
    def klass(cls, x: int) -> int:
        """A class method.

        Args:
            x: A number.
        """
        return x


def no_hint(a, b: int) -> int:
    """Add.

    Args:
        a: first
        b: second
    """
    return b


def no_arg_doc(a: int, b: int) -> int:
    """Add.

    Args:
        a: first
    """
    return a


def custom(a: Methods) -> int:
    """Custom.

    Args:
        a: An object.
    """
    return 0


def one_tuple(a: tuple[int]) -> int:
    """One.

    Args:
        a: A one-element tuple.
    """
    return 0


SAME = [add, basics, containers, unions, returns_unconvertible, Methods().plain, Methods.klass]


@pytest.mark.parametrize("fn", SAME, ids=lambda fn: fn.__name__)
def test_schemas_equal_transformers_get_json_schema(fn):
    assert tool_schema(fn) == get_json_schema(fn)


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (undocumented, "it has no docstring"),
        (no_hint, "the argument 'a' has no type hint"),
        (no_arg_doc, "its docstring has no description for the argument 'b'"),
        (custom, "has no JSON schema (a custom class or object)"),
        (one_tuple, "is a one-element tuple"),
    ],
)
def test_what_transformers_refuses_is_one_sentence_naming_the_tool(fn, why):
    with pytest.raises(Exception):  # noqa: B017  transformers' own exceptions are plain
        get_json_schema(fn)
    with pytest.raises(ToolError) as info:
        tool_schema(fn)
    message = str(info.value)
    assert message.startswith(f"tool {fn.__qualname__} cannot be offered to the model: ") and why in message
    assert "\n" not in message


def test_making_a_schema_imports_no_transformers():
    code = (
        "import sys\nfrom leangrpo.environments.schema import tool_schema\n"
        "from leangrpo.environments.worker import prepare, supervise\n"
        "def f(a: int) -> int:\n    '''F.\n\n    Args:\n        a: A.\n    '''\n    return a\n"
        "tool_schema(f)\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
