"""Tools a recipe can name (`rollout.tools: [docuchat_rl.toolbox.calculate]`): plain functions with type hints
and docstrings, as TRL's tools are written.

Deliberately left out: tools with side effects (files, network, a Python interpreter); write your own and
name it by its dotted path.
"""

from __future__ import annotations

import ast
import operator

from simpleeval import SimpleEval

_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.USub: operator.neg, ast.UAdd: operator.pos}
_EVAL = SimpleEval(operators=_ARITHMETIC, functions={}, names={})


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with +, -, *, / and parentheses.

    Args:
        expression: The expression, for example "(12 + 7) * 3".

    >>> calculate("(12 + 7) * 3"), calculate("7 / 2"), calculate("10 / 5")
    ('57', '3.5', '2')
    >>> calculate("2 ** 8")
    'Error: only numbers, + - * / and parentheses are allowed'
    """
    try:
        value = _EVAL.eval(str(expression))
    except ZeroDivisionError:
        return "Error: division by zero"
    except Exception:  # noqa: BLE001 (simpleeval's refusals and Python's syntax errors alike: the model is told)
        return "Error: only numbers, + - * / and parentheses are allowed"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)
