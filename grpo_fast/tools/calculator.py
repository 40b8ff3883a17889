"""The built-in `calculator` tool: exact arithmetic on an expression the model writes.

Evaluated by walking Python's `ast` of the expression, never `eval`: only numbers and the
operators + - * / // % ** (with parentheses, unary minus and plus) are accepted, so nothing the
model writes can reach a name, an attribute or a call. Numbers are exact fractions
(`fractions.Fraction`): 0.1 + 0.2 is 0.3, and integers of any size stay exact. Every value is
bounded (`MAX_BITS`), and a power is refused before it is computed when its result would pass
that bound, so `9**9**9` is an error, not a hang. Errors raise ValueError or ZeroDivisionError
with a message for the model; `run_tool_calls` turns them into its `{"error": ...}` answer.
"""

import ast
import re
from fractions import Fraction

# Bound on the numerator and the denominator of every value, in bits (about 3000 decimal
# digits): below Python's 4300-digit limit on int <-> str conversion, and fast to multiply.
MAX_BITS = 10_000
# Longest expression accepted: bounds parsing.
MAX_CHARS = 2_000
# Deepest tree walked. Checked by count, not left to RecursionError: Python's recursion limit
# is process state that other libraries raise (torch's inductor sets it to at least 2000).
MAX_DEPTH = 200
# Largest power of ten a literal like 1e5 may carry.
_MAX_LITERAL_EXPONENT = 1_000
_NUMBER = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?")
_BINARY = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers and decimals with + - * / // % ** and parentheses.

    Args:
        expression: The arithmetic expression to evaluate, such as "(17 * 23 - 4) ** 2 / 3".

    Returns:
        The exact result: an integer, a decimal such as "3.5", or a fraction such as "7/3 (about 2.333333333)".
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string such as '2 * (3 + 4)', got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise ValueError(f"the expression is {len(expression)} characters long; at most {MAX_CHARS} are accepted")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        shown = expression if len(expression) <= 200 else expression[:200] + "..."
        raise ValueError(f"not an arithmetic expression ({exc.msg}): {shown!r}") from None
    except (RecursionError, MemoryError):
        raise ValueError("the expression is nested too deeply") from None
    try:
        value = _evaluate(tree.body, expression, 0)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None
    return format_number(value)


def format_number(value: Fraction) -> str:
    """An exact Fraction as text: "12", "-3.5", or "7/3 (about 2.333333333)" when no decimal ends."""
    if value.denominator == 1:
        return str(value.numerator)
    denominator = value.denominator
    twos = fives = 0
    while denominator % 2 == 0:
        denominator //= 2
        twos += 1
    while denominator % 5 == 0:
        denominator //= 5
        fives += 1
    if denominator == 1:  # 2^a 5^b: the decimal terminates after max(a, b) digits
        places = max(twos, fives)
        digits = str(abs(value.numerator) * 10**places // value.denominator).rjust(places + 1, "0")
        sign = "-" if value < 0 else ""
        return f"{sign}{digits[:-places]}.{digits[-places:]}"
    return f"{value.numerator}/{value.denominator} (about {_approximate(value)})"


def _approximate(value: Fraction) -> str:
    # float() overflows past ~1e308; the numerator and denominator here may reach 3000 digits.
    try:
        return f"{float(value):.10g}"
    except OverflowError:
        return "-inf" if value < 0 else "inf"


def _evaluate(node: ast.AST, source: str, depth: int) -> Fraction:
    if depth > MAX_DEPTH:
        raise ValueError(f"the expression is nested too deeply (more than {MAX_DEPTH} levels)")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"only numbers are allowed, got {node.value!r}")
        return _literal(node, source)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand, source, depth + 1)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY):
        left, right = _evaluate(node.left, source, depth + 1), _evaluate(node.right, source, depth + 1)
        return _bounded(_apply(node.op, left, right))
    what = ast.get_source_segment(source, node) or type(node).__name__
    raise ValueError(
        f"{what!r} is not allowed: only numbers, + - * / // % ** and parentheses are (no names, calls or comparisons)"
    )


def _literal(node: ast.Constant, source: str) -> Fraction:
    # Read the literal's own text, not the parsed float: 0.1 must be exactly 1/10.
    text = (ast.get_source_segment(source, node) or repr(node.value)).replace("_", "")
    match = _NUMBER.fullmatch(text)
    if match is None:  # 0x1F, 0o7, 0b1: Python's own exact integer value
        if isinstance(node.value, int):
            return _bounded(Fraction(node.value))
        raise ValueError(f"cannot read the number {text!r}")
    if match.group(2) is not None and abs(int(match.group(2))) > _MAX_LITERAL_EXPONENT:
        raise ValueError(f"the number {text!r} has an exponent beyond ±{_MAX_LITERAL_EXPONENT}")
    return _bounded(Fraction(text))


def _apply(op: ast.operator, left: Fraction, right: Fraction) -> Fraction:
    if isinstance(op, ast.Add):
        return left + right
    if isinstance(op, ast.Sub):
        return left - right
    if isinstance(op, ast.Mult):
        return left * right
    if isinstance(op, ast.Pow):
        return _power(left, right)
    if right == 0:
        raise ZeroDivisionError("division by zero")
    if isinstance(op, ast.Div):
        return left / right
    if isinstance(op, ast.FloorDiv):
        return Fraction(left // right)
    return left % right


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ValueError(f"only whole exponents are exact; got {format_number(exponent)}")
    n = exponent.numerator
    if base == 0 and n < 0:
        raise ZeroDivisionError("zero cannot be raised to a negative power")
    if base in (0, 1):
        return base
    if base == -1:
        return Fraction(-1 if n % 2 else 1)
    # |base^n| has about |n| times the bits of base's numerator and denominator: refuse before computing.
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if abs(n) * (bits - 1) > MAX_BITS:
        raise ValueError(f"the power's result would have more than {MAX_BITS} bits (about {MAX_BITS * 3 // 10} digits)")
    return base**n


def _bounded(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise ValueError(f"the result has more than {MAX_BITS} bits (about {MAX_BITS * 3 // 10} digits)")
    return value
