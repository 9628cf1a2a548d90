"""instruct: single-turn instruction following with constraints checked by code (IFEval-style).

Every prompt is a small writing task plus one to three verifiable constraints,
generated from a seed, e.g.

    Write a short paragraph about coffee. Answer in at most 25 words.
    Include the word "cup". Write everything in lowercase letters.

The agent is one plain ``openai`` chat call. Reward: the fraction of the
prompt's constraints the reply satisfies (an empty reply gets 0, since "at
most 25 words" and "do not use X" would otherwise reward saying nothing).

    python train.py --harness instruct
"""

from __future__ import annotations

import json
import random
import re

import openai

from lightning_lite.harness import Endpoint, Harness, Task

SYSTEM_PROMPT = "Follow every instruction in the request exactly."

TOPICS = {  # topic -> words that fit it (for "include" and "do not use")
    "the ocean": ["water", "waves", "fish", "salt"],
    "coffee": ["beans", "morning", "cup", "bitter"],
    "winter": ["snow", "cold", "coat", "ice"],
    "a city park": ["trees", "grass", "bench", "dogs"],
    "cooking": ["kitchen", "recipe", "pan", "taste"],
    "bicycles": ["wheels", "ride", "road", "helmet"],
    "the moon": ["night", "light", "sky", "craters"],
    "a birthday party": ["cake", "friends", "gifts", "candles"],
    "rain": ["clouds", "umbrella", "wet", "drops"],
    "libraries": ["books", "quiet", "read", "shelves"],
    "gardening": ["soil", "seeds", "flowers", "sun"],
    "trains": ["tracks", "station", "ticket", "travel"],
    "cats": ["fur", "purr", "sleep", "mice"],
    "music": ["song", "rhythm", "notes", "sing"],
    "the desert": ["sand", "heat", "camels", "dry"],
    "space travel": ["rocket", "stars", "planet", "astronaut"],
    "football": ["ball", "goal", "team", "match"],
    "mountains": ["peak", "climb", "rocks", "snow"],
    "bread": ["flour", "oven", "crust", "butter"],
    "the internet": ["website", "search", "email", "online"],
}
TASKS = [
    "Write a short paragraph about {topic}.",
    "Describe {topic} to a friend.",
    "Give some advice about {topic}.",
    "Explain why people like {topic}.",
    "Write a very short story about {topic}.",
    "Tell me some facts about {topic}.",
]
ENDINGS = ["Is there anything else I can help with?", "That is all.", "Thank you for reading."]

# ---------------------------------------------------------------------------- the checks

WORD_RE = re.compile(r"[A-Za-z0-9]+(?:'[A-Za-z]+)?")


def words(text: str) -> list[str]:
    """words("It's 3 o'clock, ok?") == ["It's", "3", "o'clock", "ok"]"""
    return WORD_RE.findall(text)


def sentences(text: str) -> int:
    """Pieces of text ended by . ! or ? (or the end) that hold a word: sentences("Hi. Bye!") == 2."""
    return sum(1 for s in re.split(r"[.!?]+", text) if WORD_RE.search(s))


def has_word(text: str, word: str) -> bool:
    """Whole word, any case: has_word("Cups and a Cup.", "cup") is True, has_word("cups", "cup") is False."""
    return re.search(rf"\b{re.escape(word)}\b", text, re.IGNORECASE) is not None


def is_json(text: str) -> bool:
    """The whole reply parses as JSON (a ```json fence around it is allowed)."""
    body = re.sub(r"^```(?:json)?\s*|\s*```$", "", text.strip())
    try:
        json.loads(body)
        return True
    except json.JSONDecodeError:
        return False


def bullets(text: str) -> int:
    """Lines that start with "- " or "* " (markdown bullets)."""
    return sum(1 for line in text.splitlines() if re.match(r"\s*[-*]\s", line))


CHECKS = {  # kind -> (instruction, check(text, arg))
    "max_words": ("Answer in at most {arg} words.", lambda t, n: len(words(t)) <= n),
    "min_words": ("Write at least {arg} words.", lambda t, n: len(words(t)) >= n),
    "max_sentences": ("Use at most {arg} sentences.", lambda t, n: sentences(t) <= n),
    "include": ('Include the word "{arg}".', has_word),
    "forbid": ('Do not use the word "{arg}".', lambda t, w: not has_word(t, w)),
    "json": ("Format your entire answer as valid JSON.", lambda t, _: is_json(t)),
    "bullets": (
        'Answer with exactly {arg} bullet points, each line starting with "- ".',
        lambda t, n: bullets(t) == n,
    ),
    "lowercase": (
        "Write everything in lowercase letters, no capitals.",
        lambda t, _: t == t.lower(),
    ),
    "uppercase": ("Write everything in capital letters.", lambda t, _: t == t.upper()),
    "ends_with": (
        'End your answer with the exact phrase "{arg}"',
        lambda t, p: t.strip().endswith(p),
    ),
}
# At most one constraint of a group per prompt, and never two that contradict each other.
GROUP = {
    "max_words": "length",
    "min_words": "length",
    "max_sentences": "length",
    "json": "format",
    "bullets": "format",
    "lowercase": "case",
    "uppercase": "case",
    "include": "include",
    "forbid": "forbid",
    "ends_with": "end",
}
CONFLICTS = {
    frozenset(p)
    for p in [
        ("ends_with", "json"),
        ("ends_with", "lowercase"),
        ("ends_with", "uppercase"),
        ("max_sentences", "json"),
        ("max_sentences", "bullets"),
    ]
}


def instruction(c: dict) -> str:
    """instruction({"kind": "max_words", "arg": 25}) == "Answer in at most 25 words." """
    return CHECKS[c["kind"]][0].format(arg=c["arg"])


def check(c: dict, text: str) -> bool:
    """Does ``text`` satisfy constraint ``c`` ({"kind": ..., "arg": ...})?"""
    return bool(CHECKS[c["kind"]][1](text, c["arg"]))


def score(text: str, constraints: list[dict]) -> float:
    """Fraction of ``constraints`` that ``text`` satisfies; 0.0 for a reply without a word.

    >>> cs = [{"kind": "max_words", "arg": 5}, {"kind": "include", "arg": "cup"}]
    >>> score("A cup of coffee.", cs), score("Coffee is a hot drink made from beans.", cs), score("", cs)
    (1.0, 0.0, 0.0)
    """
    if not words(text or ""):
        return 0.0
    return sum(check(c, text) for c in constraints) / len(constraints)


# ---------------------------------------------------------------------------- the tasks


def make_prompt(rng: random.Random) -> tuple[str, list[dict]]:
    """One task + 1 to 3 compatible constraints -> (prompt, constraints)."""
    topic = rng.choice(sorted(TOPICS))
    topic_words = rng.sample(TOPICS[topic], 2)  # include one, forbid the other: never the same word
    args = {
        "max_words": rng.choice([15, 25, 40]),
        "min_words": rng.choice([10, 20]),
        "max_sentences": rng.choice([2, 3, 4]),
        "include": topic_words[0],
        "forbid": topic_words[1],
        "json": None,
        "bullets": rng.choice([2, 3, 4]),
        "lowercase": None,
        "uppercase": None,
        "ends_with": rng.choice(ENDINGS),
    }
    chosen, target = [], rng.choice([1, 2, 3])
    for kind in rng.sample(sorted(CHECKS), len(CHECKS)):
        if len(chosen) == target:
            break
        if all(GROUP[k] != GROUP[kind] and frozenset((k, kind)) not in CONFLICTS for k in chosen):
            chosen.append(kind)
    constraints = [{"kind": k, "arg": args[k]} for k in chosen]
    prompt = " ".join(
        [rng.choice(TASKS).format(topic=topic)] + [instruction(c) for c in constraints]
    )
    return prompt, constraints


class InstructHarness(Harness):
    name = "instruct"

    def __init__(
        self,
        n_train: int = 1000,
        n_test: int = 200,
        seed: int = 0,
        max_tokens: int = 96,
        temperature: float = 0.7,
    ):
        self.n = {"train": n_train, "test": n_test}
        self.seed, self.max_tokens, self.temperature = seed, max_tokens, temperature
        self._tasks: dict[str, list[Task]] = {}

    def tasks(self, split: str) -> list[Task]:
        """Deterministic in (seed, sizes). Test is generated first and train skips every
        test prompt, so the splits never share a prompt."""
        if split not in self.n:
            raise ValueError(f"instruct has splits 'train' and 'test', not {split!r}")
        if not self._tasks:
            seen: set[str] = set()
            for s in ("test", "train"):
                rng, self._tasks[s] = random.Random(f"instruct-{s}-{self.seed}"), []
                for _ in range(50 * self.n[s] + 1000):  # never spin on an impossible size
                    if len(self._tasks[s]) == self.n[s]:
                        break
                    prompt, constraints = make_prompt(rng)
                    if prompt not in seen:
                        seen.add(prompt)
                        self._tasks[s].append(
                            Task(f"instruct-{s}-{len(self._tasks[s])}", prompt, constraints)
                        )
                else:
                    raise ValueError(f"instruct has too few distinct prompts for n_{s}={self.n[s]}")
        return self._tasks[split]

    async def run(self, task: Task, endpoint: Endpoint) -> float:
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
        ) as client:
            r = await client.chat.completions.create(
                model=endpoint.model,
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                messages=[
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": task.prompt},
                ],
            )
        return score(r.choices[0].message.content or "", task.answer)
