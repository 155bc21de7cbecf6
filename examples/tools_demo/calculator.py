"""The tool-use demo's one tool (examples/tools_demo/README.md): the calculator's `add`."""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum a + b.
    """
    return int(a) + int(b)
