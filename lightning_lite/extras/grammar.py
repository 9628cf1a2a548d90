"""Constrained decoding: a forced tool call (tool_choice a named function or "required") or a JSON
``response_format`` follows its JSON schema, because each token is drawn under a grammar's mask
(llguidance, the library vLLM's "guidance" backend uses). The mask is part of the sampling
distribution: a token the grammar forces has probability 1 there, so the trainer scores the tokens
under the same mask, replayed over the recorded ids (a grammar's masks depend only on the ids
before: the same masks, DESIGN.md "Constrained calls").

    g = tool_grammar("hermes", tools, "calculator", tok)   # what follows toolcalls.forced("hermes", "calculator"):
        start: " " %json {...its parameters...} "}\\n</tool_call>"
    m = Matcher(g, tok, n_vocab)       # the sampler: m.allowed() -> [V] bool, m.consume(token)
    replay(g, response_ids, tok, n_vocab)  # the trainer: [n, ceil(V / 32)] int32, each position's mask, packed

Arguments are written as ``json.dumps`` writes them (", " and ": ", no other whitespace), as chat
templates render them: the same text the history renders later, and no free whitespace for a small
model to wander in; an object that lists its properties has no others unless its schema says so
(``_closed``).

How it reaches the core: the proxy calls ``constrain``, which puts ``tool_grammar``'s or
``json_grammar``'s text into ``Sampling.grammar``, a backend samples under its ``Matcher``, the
trainer scores under its ``Replay`` (``replay_samples``) and counts the tokens it constrained and
forced (``Counts``). Of a tool-call format it reads only ``Format.call``, the call's text around its
arguments (toolcalls.format_of)."""

import json
import re
import sys
from typing import Optional

import llguidance
import llguidance.hf
import torch

from .. import hooks
from ..algo import all_reduce
from ..chat import BadRequest
from ..records import Sample
from ..toolcalls import format_of

JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
# (id(tokenizer), n_vocab) -> (tokenizer, its llguidance tokenizer, its special tokens' pattern,
# their ids)
_TOKENIZERS: dict = {}


def _ll(tok, n_vocab: Optional[int] = None):
    """The llguidance tokenizer of ``tok`` (~1 s to build: once per process), as vLLM builds it:
    ``n_vocab`` ids (the model's logits; default the tokenizer's), its EOS; and a pattern of the
    special tokens, which a grammar names by id."""
    key = (id(tok), n_vocab or len(tok))
    if key not in _TOKENIZERS:
        ll = llguidance.hf.from_tokenizer(tok, max(n_vocab or 0, len(tok)))
        added = tok.added_tokens_decoder.items()
        special = {t.content: i for i, t in added if ll.is_special_token(i)}
        longest_first = sorted(special, key=len, reverse=True)
        pattern = re.compile("|".join(map(re.escape, longest_first))) if special else None
        # tok held: its id stays its own
        _TOKENIZERS[key] = (tok, ll, pattern, special)
    return _TOKENIZERS[key][1:]


def _text(s: str, tok) -> str:
    """Grammar for the literal text ``s``: a special token by id (the model samples it as that
    token; its text is not text to llguidance), the rest as quoted strings (none: "").  '}<|call|>'
    -> '"}" <[200012]>'."""
    _, pattern, special = _ll(tok)
    parts, pos = [], 0
    for m in pattern.finditer(s) if pattern else ():
        parts += [json.dumps(s[pos : m.start()], ensure_ascii=False)] if m.start() > pos else []
        parts.append(f"<[{special[m.group()]}]>")
        pos = m.end()
    parts += [json.dumps(s[pos:], ensure_ascii=False)] if pos < len(s) else []
    return " ".join(parts)


def _closed(schema):
    """``schema`` with ``additionalProperties: false`` wherever it lists properties and says nothing
    of others (as OpenAI's strict mode): a small model otherwise fills a call with keys of its own
    invention."""
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    props = lambda v: {n: _closed(x) for n, x in v.items()} if isinstance(v, dict) else v
    out = {k: props(v) if k == "properties" else _closed(v) for k, v in schema.items()}
    closed = "properties" in out and "additionalProperties" not in out
    return {**out, "additionalProperties": False} if closed else out


def _json(schema) -> str:
    schema = _closed(schema) if isinstance(schema, dict) and schema else {"type": "object"}
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)


def json_grammar(schema: dict) -> str:
    """A reply that is one JSON value following ``schema`` (``response_format``), then the end of
    the turn."""
    return "start: " + _json(schema)


def _until(close: str, tok, name: str) -> tuple[str, list[str]]:
    """Any text up to ``close``, then ``close``: a special token is not text, so it simply follows a
    lexeme of text; other text ends the lexeme at its first occurrence, which the lexeme includes.
    -> (the value, lexemes)."""
    if _ll(tok)[1] and _ll(tok)[1].fullmatch(close):
        return f"{name} {_text(close, tok)}", [f"{name}: /(?s:.*)/"]
    regex = "".join(
        "\\n" if c == "\n" else "\\" + c if c in "\\/.^$|?*+()[]{}-" else c for c in close
    )
    return name, [f"{name}: /(?s:.*){regex}/ & ~/(?s:.*){regex}(?s:.)+/"]


def _params(schema: dict, tok, k: int, param: tuple) -> tuple[str, list[str]]:
    """Arguments written a parameter at a time (``Format.param``: Qwen3-Coder's
    ``<parameter=A>\\nV\\n</parameter>\\n``, OLMo 3's ``A=V, B=W``), the required ones first: a
    string value is any text up to the closing tag or quote, else JSON; another value JSON of its
    property's schema. -> (the rule's body, lexemes)."""
    before, after, sep, quote = (*param, "", "")[:4]
    props, required = schema.get("properties") or {}, set(schema.get("required") or [])
    # what a property's "$ref" points into
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    items, lexemes = [], []
    for j, (name, sub) in enumerate(sorted(props.items(), key=lambda p: p[0] not in required)):
        # a close may name the key again (MiniMax M3's </city>)
        close = after.replace("{name}", name)
        if isinstance(sub, dict) and sub.get("type") == "string" and (close or quote):
            value, more = _until(close or quote, tok, f"STR{k}_{j}")
            value, lexemes = f"{_text(quote, tok)} {value}", lexemes + more
        else:
            value = (
                f"{_json({**sub, **defs} if isinstance(sub, dict) else sub)} {_text(close, tok)}"
            )
        items.append(f"{_text(before.replace('{name}', name), tok)} {value}")
    # the separator goes between the values given: after the required ones, before each optional one
    sep, n = _text(sep, tok), len(required & set(props))
    tail = lambda j: " ".join(f"({sep} {item})?" for item in items[j:])
    if n:
        return f" {sep} ".join(items[:n]) + " " + tail(n), lexemes
    firsts = [f"{item} {tail(j + 1)}" for j, item in enumerate(items)]
    return (f"({' | '.join(firsts)})?" if items else '""'), lexemes


def tool_grammar(fmt: str, tools: list[dict], name: str, tok) -> str:
    """The grammar of what the model writes after ``toolcalls.forced(fmt, name)``: one call of the
    tool ``name`` (of any of ``tools`` when ""), its arguments following the tool's ``parameters``
    schema, closed as the template closes a call; then the end of the turn."""
    rules, lexemes = [], []
    for k, t in enumerate(x for x in tools if x["name"] == name or not name):
        schema = t.get("parameters") if isinstance(t.get("parameters"), dict) else {}
        head = "" if name else t["name"]
        # the call's text around its arguments: toolcalls.forced wrote what comes before the name
        form = format_of(fmt)
        _, between, after = form.call
        # <tool_call>\n<function=N>\n PARAMETERS </function>\n</tool_call>
        if form.param:
            params, more = _params(schema, tok, k, form.param)
            lexemes += more
            rule = f"{_text(head + between, tok) if head else ''} {params} {_text(after, tok)}"
        else:
            # named: forced() wrote the name and `between` less a trailing space (the model's token
            # carries it)
            lead = head + between if head else between[len(between.rstrip(" ")) :]
            rule = " ".join(x for x in (_text(lead, tok), _json(schema), _text(after, tok)) if x)
        rules.append(f"call{k}: {rule.strip()}")
    start = f"start: {' | '.join(f'call{k}' for k in range(len(rules)))}"
    return "\n".join([start, *rules, *lexemes])


def constrain(req, renderer, opened: bool) -> str:
    """A request's forced call or JSON reply: its grammar put into ``req.sampling``, the text its
    reply is forced to begin with returned. The forced call's arguments follow their tool's schema,
    a response_format's JSON its schema; a schema llguidance cannot compile is a 400 with its
    message. A request with neither gets "" and no grammar."""
    if req.force_tool is None and req.response_schema is None:
        return ""
    fmt, tok = renderer.format, renderer.tok
    param, rules = "response_format", json_grammar(req.response_schema or {})
    if req.force_tool is not None:
        param, rules = "tools", tool_grammar(fmt, req.tools, req.force_tool, tok)
    # llguidance's first line says what (the rest points into a grammar the client never wrote)
    if error := check(rules, tok):
        message = f"the {param} JSON schema cannot be enforced: {error.strip().splitlines()[0]}"
        raise BadRequest(message, param, "invalid_schema")
    req.sampling.grammar = rules
    return renderer.forced_prefix(req.force_tool, opened, req.response_schema is not None)


def check(grammar: str, tok) -> Optional[str]:
    """None when llguidance compiles ``grammar`` for ``tok``, else its message (a schema it cannot
    follow)."""
    lark = llguidance.grammar_from("lark", grammar)
    return llguidance.LLMatcher.validate_grammar(lark, _ll(tok)[0]) or None


class Matcher:
    """One reply's grammar state: the tokens it allows next, as [V] bool (V: ``n_vocab``, the
    model's logits)."""

    def __init__(self, grammar: str, tok, n_vocab: int):
        self.ll, self.n_vocab = _ll(tok, n_vocab)[0], n_vocab
        lark = llguidance.grammar_from("lark", grammar)
        self.m = llguidance.LLMatcher(self.ll, lark, log_level=0)
        if self.m.is_error():
            raise ValueError(f"the grammar does not compile: {self.m.get_error()}")

    def packed(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.m.compute_bitmask()), dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        return unpack_bits(self.packed()[None], self.n_vocab)[0]

    def consume(self, token: int):
        # the sampler drew from the mask: a token outside it is a bug, never the model's doing
        if not self.m.consume_token(token):
            raise RuntimeError(f"token {token} is outside the grammar: {self.m.get_error()[:300]}")


def replay(grammar: str, ids: list[int], tok, n_vocab: int) -> torch.Tensor:
    """The packed mask each of ``ids`` was drawn under (the trainer's side of ``Matcher``):
    [len(ids), W] int32."""
    m, rows = Matcher(grammar, tok, n_vocab), []
    for t in ids:
        rows.append(m.packed())
        m.consume(t)
    return torch.stack(rows) if rows else torch.zeros(0, (n_vocab + 31) // 32, dtype=torch.int32)


def unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """[N, W] int32 bitmasks (bit j of word i: token 32 i + j, as llguidance packs them) -> [N, n]
    bool.

    >>> unpack_bits(torch.tensor([[5]], dtype=torch.int32), 4)
    tensor([[ True, False,  True, False]])
    """
    # Unpacked by byte (little-endian, as every platform torch runs on: bit b of byte m is token
    # 8 m + b), so the widest intermediate is one byte per token: [1024, 152k] is 155 MB, where
    # 32-bit shifts made 620 MB.
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    # [N, 4 W, 1] bytes -> [N, 4 W, 8] bits -> [N, 32 W] -> the first n
    as_bytes = bits.contiguous().view(torch.uint8)[:, :, None]
    return ((as_bytes >> shifts) & 1).view(torch.bool).flatten(1)[:, :n]


def sample_masks(s: Sample, tok, n_vocab: int) -> Optional[tuple[list[int], torch.Tensor]]:
    """(positions, [n, W] packed masks) of ``s``'s grammar-constrained trainable tokens, for
    ``Replay``: each constrained call's masks replayed over its response, which the sample
    holds whole (samples.build_samples); None when it has none."""
    pos, rows = [], []
    for k, g in s.grammars.items():
        # its response: one run of positions
        at = [i for i, c in enumerate(s.call) if c == int(k)]
        rows.append(replay(g, [s.tokens[i] for i in at], tok, n_vocab))
        pos += at
    return (pos, torch.cat(rows)) if rows else None


def forced(masks: torch.Tensor) -> int:
    """How many of these packed masks allow a single token: tokens the grammar forced (logprob 0, no
    gradient)."""
    return int((unpack_bits(masks, 32 * masks.shape[1]).sum(1) == 1).sum())


class Replay:
    """The grammar masks that drew a micro-batch's constrained tokens, replayed over its samples'
    recorded ids: algo.trainer_logprobs' ``allowed``, so that the trainer scores each token under
    the mask the sampler drew it under. ``constrained`` counts those tokens, ``forced`` the ones a
    mask allowed alone. One sample or more was sampled under a grammar (``Sample.grammars``)."""

    def __init__(self, samples: list[Sample], tok, n_vocab: int):
        width = max(len(s.tokens) for s in samples)
        # [B, T]: each position's row of the stacked masks, -1 where no grammar constrained it
        self.row_at = torch.full((len(samples), width), -1, dtype=torch.long)
        rows = []
        for i, s in enumerate(samples):
            masks = sample_masks(s, tok, n_vocab)
            if masks is None:
                continue
            positions, packed = masks
            first_row = sum(len(r) for r in rows)
            self.row_at[i, positions] = torch.arange(len(positions)) + first_row
            rows.append(packed)
        # [M, W]: every constrained token's packed mask
        self.masks = torch.cat(rows)
        self.constrained = len(self.masks)
        self.forced = forced(self.masks)

    def __call__(self, index: torch.Tensor, n_vocab: int) -> Optional[torch.Tensor]:
        """[n] flat positions in the batch's [B, T] -> [n, n_vocab] bool, what each token was drawn
        from (all of it where no grammar constrained the token), or None where none was."""
        # onto the model's device once, not once per chunk
        if self.masks.device != index.device:
            self.masks = self.masks.to(index.device)
            self.row_at = self.row_at.to(index.device)
        at = self.row_at.view(-1)[index]
        constrained = at >= 0
        if not bool(constrained.any()):
            return None
        allowed = torch.ones(len(index), n_vocab, dtype=torch.bool, device=index.device)
        packed = self.masks[at[constrained]]
        allowed[constrained] = unpack_bits(packed, n_vocab)
        return allowed


def replay_samples(samples: list[Sample], tok, n_vocab: int) -> Optional[Replay]:
    """A micro-batch's ``Replay`` (algo.trainer_logprobs' ``allowed``), or None when no sample was
    sampled under a grammar."""
    if not any(s.grammars for s in samples):
        return None
    return Replay(samples, tok, n_vocab)


class Counts:
    """hooks.LOSS_METRICS: of a pass's trained tokens, those a grammar constrained
    (constrained_tokens) and those it forced (forced_tokens: its mask allowed one token alone), over
    all ranks. Each micro-batch's batch["allowed"] is its ``replay_samples``."""

    def __init__(self):
        self.constrained = 0
        self.forced = 0

    def add(self, samples, batch, logprobs, entropy):
        if batch["allowed"] is not None:
            self.constrained += batch["allowed"].constrained
            self.forced += batch["allowed"].forced

    def result(self) -> dict[str, int]:
        constrained, forced = all_reduce([self.constrained, self.forced])
        return {"constrained_tokens": int(constrained), "forced_tokens": int(forced)}


# Its hooks: the proxy constrains forced calls through this module, the backend samples under its
# Matcher, the trainer scores under its replay_samples (hooks.grammar) and counts what it
# constrained (hooks.LOSS_METRICS).
hooks.grammar = sys.modules[__name__]
hooks.LOSS_METRICS.append(Counts)
