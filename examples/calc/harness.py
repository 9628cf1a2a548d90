"""calc: arithmetic word problems, solved by a tiny tool-using agent.

Tasks are generated from a seed (no data files), e.g. at difficulty 1:

    Tom has 3 apples and buys 4 more. How many apples does Tom have now?

The agent is plain ``openai`` client code: its first call must call the
``calculator`` tool (``tool_choice``), the result is fed back, and it answers
(at most ``max_turns`` model calls), ending with ``ANSWER: <number>``. So every
rollout is a multi-turn conversation that merges into one training sample.
Reward: ``tool_reward`` for a first calculator call that computes the problem's own
arithmetic (an expression with an operator, on the problem's numbers, whose value is
the answer: a bare number, which the model learned to pass when any number counted,
or other arithmetic earns nothing), plus ``1 - tool_reward`` times the answer's score
(1.0 for the exact number, ``format_reward`` for a well-formed wrong answer, 0.0 otherwise). ``call_rewards=True`` rewards the calls apart instead: the
first call 1.0 when it is such a calculator call (a per-call reward on its own tokens,
for ``--adv grpo-step``), the rollout the answer's score alone.
Sized for a 135M model on a CPU: short prompts, small numbers, few short turns.

    python train.py --harness calc --harness-arg difficulty=1
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re

import openai

from lightning_lite.harness import Endpoint, Harness, Task

SYSTEM_PROMPT = """\
Solve the math problem. You can use the calculator tool.
End your reply with the final number like this: ANSWER: <number>

Example:
Problem: Sam has 2 pens and buys 5 more. How many pens does Sam have now?
Reply: 2 + 5 = 7. ANSWER: 7"""

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression, e.g. 3+4 or 6*7.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 3+4"}},
            "required": ["expression"],
        },
    },
}

NAMES = ["Tom", "Ann", "Sam", "Mia", "Ben", "Lily", "Max", "Emma", "Leo", "Zoe"]
ITEMS = ["apples", "pens", "books", "coins", "cards", "cookies", "marbles", "stickers"]

# ---------------------------------------------------------------------------- scoring

ANSWER_RE = re.compile(r"answer\s*[:=]\s*[*$\s]*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)


NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _value(s: str):
    try:
        return float(s.replace(",", ""))
    except ValueError:  # "1,2,3" and the like
        return None


def score(text: str, answer: float, format_reward: float = 0.1, strict: bool = False) -> float:
    """1.0 if the final answer in ``text`` is ``answer``; ``format_reward`` for a wrong
    answer given as ``ANSWER: <number>``; 0.0 otherwise.

    The final answer is the last ``ANSWER: <number>``; without one, and unless
    ``strict``, the last number in the text. (SmolLM2-135M almost never writes
    the ANSWER line unprompted but often ends with the result, "3 + 4 = 7.":
    the lenient rule gives RL a signal from the first step, and the format
    reward pulls it towards the fixed format.)

    >>> score("3 + 4 = 7. ANSWER: 7", 7), score("Answer: 7.0", 7), score("ANSWER: 8", 7), score("3 + 4 = 7.", 7)
    (1.0, 1.0, 0.1, 1.0)
    >>> score("3 + 4 = 7.", 7, strict=True), score("no number", 7)
    (0.0, 0.0)
    """
    found = ANSWER_RE.findall(text or "")
    if found:
        value = _value(found[-1])
        return 1.0 if value is not None and abs(value - float(answer)) < 1e-9 else format_reward
    numbers = [] if strict else NUMBER_RE.findall(text or "")
    value = _value(numbers[-1]) if numbers else None
    return 1.0 if value is not None and abs(value - float(answer)) < 1e-9 else 0.0


# ---------------------------------------------------------------------------- the tool

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _eval(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 100:  # 9**9**9 would hang the step
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def evaluate(expression: str):
    """Arithmetic on numbers only, via ``ast`` (never ``eval``): evaluate("6*7") == 42."""
    return _eval(ast.parse(expression, mode="eval").body)


def _arith(expression) -> str:
    return (
        str(expression).replace("^", "**").replace("×", "*").replace("x", "*")
    )  # how people write them


def calculator(arguments: str) -> str:
    """The tool: JSON arguments as the model wrote them -> result text. Never raises,
    because a malformed call should teach the model, not crash the rollout.

    >>> calculator('{"expression": "3+4"}'), calculator('{"expression": "1/0"}')
    ('7', 'error: division by zero')
    """
    try:
        args = json.loads(arguments or "{}")
        expression = args.get("expression") if isinstance(args, dict) else args
        if not isinstance(expression, (str, int, float)):
            return 'error: call calculator with {"expression": "3+4"}'
        value = evaluate(_arith(expression))
        if isinstance(value, float):
            value = int(value) if value.is_integer() else round(value, 6)
        return str(value)
    except json.JSONDecodeError:
        return 'error: arguments must be JSON like {"expression": "3+4"}'
    except Exception as e:  # SyntaxError, ZeroDivisionError, OverflowError, ValueError
        return f"error: {e}"


def computes(arguments: str, problem: str, answer: float) -> bool:
    """Does a calculator call compute the problem's own arithmetic: an expression with an operator, on numbers
    the problem gives, whose value is the answer? A bare number (often the answer, copied), or a sum of other
    numbers that happens to give it, is not.

    >>> p = "Tom has 3 apples and buys 4 more. How many apples does Tom have now?"
    >>> [computes('{"expression": "%s"}' % e, p, 7) for e in ("3+4", "4 + 3", "7", "7+0", "1+6", "3-4")]
    [True, True, False, False, False, False]
    """
    try:
        expression = _arith(json.loads(arguments or "{}").get("expression"))
        tree = ast.parse(expression, mode="eval").body
        given = {float(x) for x in NUMBER_RE.findall(problem)}
        numbers = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
        return (
            isinstance(tree, ast.BinOp)
            and all(float(n) in given for n in numbers)
            and abs(evaluate(expression) - float(answer)) < 1e-9
        )
    except (
        ValueError,
        TypeError,
        SyntaxError,
        AttributeError,
        ArithmeticError,
        RecursionError,
    ):  # not a computation
        return False


# ---------------------------------------------------------------------------- the tasks

FIRST = {
    "+": "has {a} {item} and buys {b} more",
    "-": "has {a} {item} and gives {b} away",
    "*": "buys {a} bags with {b} {item} in each bag",
}
THEN = {"+": "finds {c} more", "-": "gives {c} away"}


def make_problem(rng: random.Random, difficulty: int) -> tuple[str, str, int]:
    """One problem -> (prompt, expression, answer); every number in it is >= 1.

    1: one + or - with results < 20 ("Tom has 3 apples and buys 4 more.")
    2: one + - or * with numbers up to 50 ("Ann buys 4 bags with 6 pens in each bag.")
    3: two operations ("..., then gives 5 away.")
    """
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    op = rng.choice("+-" if difficulty == 1 else "+-*")
    if op == "+":
        hi = 9 if difficulty == 1 else 48
        a = rng.randint(2, hi)
        b = rng.randint(2, min(hi, 50 - a))
    elif op == "-":
        a = rng.randint(4, 19 if difficulty == 1 else 50)
        b = rng.randint(2, a - 2)
    else:
        a = rng.randint(2, 9)
        b = rng.randint(2, 50 // a)
    text, expr = FIRST[op].format(a=a, b=b, item=item), f"{a}{op}{b}"
    if difficulty == 3:
        op2, value = rng.choice("+-"), evaluate(expr)
        c = rng.randint(2, 20) if op2 == "+" else rng.randint(1, value - 1)
        text, expr = f"{text}, then {THEN[op2].format(c=c)}", f"{expr}{op2}{c}"
    return f"{name} {text}. How many {item} does {name} have now?", expr, int(evaluate(expr))


# ---------------------------------------------------------------------------- the harness


class CalcHarness(Harness):
    name = "calc"

    def __init__(
        self,
        n_train: int = 2000,
        n_test: int = 200,
        difficulty: int = 1,
        seed: int = 0,
        format_reward: float = 0.1,
        max_turns: int = 3,
        max_tokens: int = 64,
        temperature: float = 0.7,
        strict: bool = False,
        tool_first: bool = True,
        tool_reward: float = 0.2,
        call_rewards: bool = False,
    ):
        if difficulty not in (1, 2, 3):
            raise ValueError(f"calc difficulty must be 1, 2 or 3, not {difficulty!r}")
        self.n = {"train": n_train, "test": n_test}
        self.difficulty, self.seed, self.format_reward = difficulty, seed, format_reward
        self.max_turns, self.max_tokens, self.temperature = max_turns, max_tokens, temperature
        self.strict, self.tool_first, self.tool_reward, self.call_rewards = (
            strict,
            tool_first,
            tool_reward,
            call_rewards,
        )
        self._tasks: dict[str, list[Task]] = {}

    def tasks(self, split: str) -> list[Task]:
        """Deterministic in (seed, difficulty, sizes). Test is generated first and
        train skips every test prompt, so the splits never share a problem."""
        if split not in self.n:
            raise ValueError(f"calc has splits 'train' and 'test', not {split!r}")
        if not self._tasks:
            seen: set[str] = set()
            for s in ("test", "train"):
                rng = random.Random(f"calc-{s}-{self.seed}-{self.difficulty}")
                self._tasks[s] = []
                for _ in range(50 * self.n[s] + 1000):  # small pools run dry: say so, never spin
                    if len(self._tasks[s]) == self.n[s]:
                        break
                    prompt, expr, answer = make_problem(rng, self.difficulty)
                    if prompt not in seen:
                        seen.add(prompt)
                        i = len(self._tasks[s])
                        self._tasks[s].append(
                            Task(
                                f"calc-d{self.difficulty}-{s}-{i}",
                                prompt,
                                answer,
                                {"expression": expr, "difficulty": self.difficulty},
                            )
                        )
                else:
                    raise ValueError(
                        f"calc difficulty {self.difficulty} has too few distinct problems "
                        f"for n_{s}={self.n[s]}; ask for fewer"
                    )
        return self._tasks[split]

    async def run(self, task: Task, endpoint: Endpoint):
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task.prompt},
        ]
        # max_retries=0: a failed call fails the rollout visibly instead of being
        # silently re-sampled (a retry would be a second, differently-sampled call).
        valid_call, first_id = False, None
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
        ) as client:
            for turn in range(self.max_turns):
                # The first call must use the calculator: the proxy starts the call, the model writes the arguments.
                first = turn == 0 and self.tool_first
                response = await client.chat.completions.create(
                    model=endpoint.model,
                    messages=messages,
                    tools=[CALCULATOR_TOOL],
                    tool_choice={"type": "function", "function": {"name": "calculator"}}
                    if first
                    else "auto",
                    max_tokens=self.max_tokens,
                    temperature=self.temperature,
                )
                message = response.choices[0].message
                first_id = response.id if first else first_id
                messages.append(
                    message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
                )
                if not message.tool_calls:
                    if not first:
                        break
                    # The forced call did not parse: say so, as a tool would, and let the model answer.
                    messages.append(
                        {
                            "role": "user",
                            "content": "That was not a valid calculator call. Answer the problem.",
                        }
                    )
                    continue
                for call in message.tool_calls:
                    result = (
                        calculator(call.function.arguments)
                        if call.function.name == "calculator"
                        else f"error: unknown tool {call.function.name!r}; use calculator"
                    )
                    valid_call |= (
                        first
                        and call.function.name == "calculator"
                        and computes(call.function.arguments, task.prompt, task.answer)
                    )
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        # The answer is whatever the model said last (a turn-limited run may end on a tool call).
        answer = score(message.content or "", task.answer, self.format_reward, self.strict)
        if not self.tool_first:
            return answer
        if (
            self.call_rewards
        ):  # the call that computed earns on its own tokens; the rollout's reward is the answer's
            return {"reward": answer, "calls": {first_id: float(valid_call)}}
        return self.tool_reward * valid_call + (1 - self.tool_reward) * answer
