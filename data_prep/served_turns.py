"""Each assistant reply as the target emits it when served, for chat templates that think.

A served reply is the text the target generates after ``render(history,
add_generation_prompt=True, **chat_template_kwargs)``: with thinking on, its reasoning, the
closing ``</think>``, the answer and the end-of-turn marker. Thinking templates do not render
that text back when the same reply is part of a longer conversation:

- Qwen3 (``enable_thinking``) renders ``<think>\\n{reasoning}\\n</think>\\n\\n`` only for replies
  after the last user turn; earlier replies lose their reasoning, and with thinking off the empty
  ``<think>\\n\\n</think>\\n\\n`` block is part of the generation prompt, not of the reply.
- DeepSeek-V3.1 (``thinking``) ends the generation prompt with ``<think>`` (thinking) or
  ``</think>`` (not), and renders every reply, even the last, as ``</think>{answer}``.
- DeepSeek-R1 ends the generation prompt with ``<think>\\n`` and renders replies without their
  reasoning.
- Kimi-K2-Thinking renders the last plain reply as ``<think></think>{answer}``, reasoning only for
  tool-call turns after it.

:func:`served_turn` therefore renders each reply as the last turn of its own conversation and
checks it against the generation prompt: where the template's rendering continues the prompt it
is taken as is (its empty think block refilled with the reply's reasoning when it dropped it);
where the prompt ends inside an open ``<think>`` and the template renders the reply another way,
the served text is put together from the reasoning, ``</think>``, the answer and the template's
end-of-turn marker. Reasoning is carried in an assistant message's ``reasoning_content`` (the
field vLLM's reasoning parsers return and Qwen3's and Kimi's templates read); a reply that still
holds ``<think>...</think>`` in its content is split by :func:`split_reasoning`.

A reply cut by ``max_tokens`` (``cut``) is served as the text the target emitted and nothing
after it: no end-of-turn marker and, when it was cut inside its reasoning, no ``</think>`` and
no answer. Such a reply has ``<think>`` (or a generation prompt that opened it) but no
``</think>``; :func:`split_reasoning` with ``cut`` reads it as reasoning with an empty answer.
A reply *not* marked cut is read as before: without ``</think>`` its whole text is the answer
(the rare reply that finished inside its reasoning, and the cut replies of regeneration caches
written before rows carried ``cut``, keep the rendering they had).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_EMPTY_THINK = re.compile(r"<think>\s*</think>")
_GENERATION_TAG = re.compile(r"{%-?\s*(end)?generation\s*-?%}")


class TemplateError(ValueError):
    """A chat template and a conversation (or the template kwargs) that cannot give the served
    text; :class:`~draftsmith.data_prep.conversations.DataError` subclasses carry the row."""


def template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template source ('' without one; several named templates: joined)."""
    tpl = getattr(tokenizer, "chat_template", None) or ""
    return tpl if isinstance(tpl, str) else "\n".join(str(v) for v in dict(tpl).values())


def is_thinking_template(tokenizer: Any) -> bool:
    """Whether the chat template knows ``</think>`` (Qwen3, DeepSeek-R1 / V3.1, Kimi-K2-Thinking)."""
    return THINK_CLOSE in template_text(tokenizer)


def template_variables(tokenizer: Any) -> set[str]:
    """The variables the chat template reads from its render context (``messages``,
    ``add_generation_prompt``, ``enable_thinking``, ...), by Jinja's own analysis
    (``jinja2.meta.find_undeclared_variables``)."""
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    # transformers' {% generation %} tag is not plain Jinja; it renders its body unchanged
    return set(meta.find_undeclared_variables(env.parse(_GENERATION_TAG.sub("", template_text(tokenizer)))))


def check_template_kwargs(tokenizer: Any, kwargs: dict | None, key: str = "data.chat_template_kwargs") -> None:
    """Refuse template kwargs the target's chat template never reads (they would silently change
    nothing: ``enable_thinking`` for DeepSeek-V3.1, whose switch is ``thinking``).

    Raises:
        TemplateError: one line naming ``key.<name>`` and the variables the template does read.
    """
    if not kwargs:
        return
    known = template_variables(tokenizer)
    for name in kwargs:
        if name not in known:
            reads = sorted(known - {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})
            raise TemplateError(f"{key}.{name}: the target's chat template never reads {name!r}, so it would change "
                                f"nothing (the template's own variables: {', '.join(reads) or 'none'}); remove it or "
                                "use the name the template reads")


def split_reasoning(text: str, cut: bool = False) -> tuple[str, str]:
    """``(reasoning, answer)`` of a raw reply: the text before the first ``</think>`` (less a
    leading ``<think>``) and the text after it, whitespace kept, so ``reasoning + "</think>" +
    answer`` is the generated text again; ``("", text)`` without ``</think>``. ``cut``: the reply
    was cut by ``max_tokens``, so a ``<think>`` head without ``</think>`` is reasoning the cut
    interrupted: ``(text after <think>, "")``."""
    head, close, tail = text.partition(THINK_CLOSE)
    at = head.find(THINK_OPEN)
    opened = at >= 0 and not head[:at].strip()
    if not close:
        return (head[at + len(THINK_OPEN):], "") if cut and opened else ("", text)
    return (head[at + len(THINK_OPEN):] if opened else head), tail


def with_reasoning(message: dict) -> dict:
    """``message`` with its reasoning in ``reasoning_content`` (from ``reasoning_content``, vLLM's
    newer ``reasoning``, or a ``<think>...</think>`` head of the content) and the answer in
    ``content``; other messages unchanged."""
    if message.get("role") != "assistant":
        return message
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    content = message.get("content")
    if not reasoning and isinstance(content, str) and THINK_CLOSE in content:
        reasoning, content = split_reasoning(content)
    out = {k: v for k, v in message.items() if k != "reasoning"}
    out["content"] = content
    if reasoning:
        out["reasoning_content"] = reasoning
    else:
        out.pop("reasoning_content", None)
    return out


def render(tokenizer: Any, messages: list[dict], template_kwargs: dict | None = None,
           add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(template_kwargs or {}))


@dataclass(frozen=True)
class ServedTurn:
    """Assistant turn ``index`` as served: ``prompt`` (the generation prompt, no label) followed by
    ``reply`` (what the target generates: reasoning when it thinks, answer, end-of-turn marker)."""

    index: int
    prompt: str
    reply: str

    @property
    def text(self) -> str:
        return self.prompt + self.reply


def _cut_reply(message: dict, open_think: bool) -> tuple[dict, bool]:
    """A reply cut by ``max_tokens`` with its reasoning in ``reasoning_content`` and its answer in
    ``content``, and whether the cut came inside the reasoning (``</think>`` never emitted).

    Reasoning given apart (a reasoning parser's field) means the answer is what came after
    ``</think>``: blank, the reply was still reasoning. Otherwise the raw text decides: a
    ``</think>`` closes the reasoning; a ``<think>`` head without it, or no marker at all after a
    generation prompt that left ``<think>`` open (``open_think``: DeepSeek-R1, V3.1 thinking), is
    reasoning the cut interrupted; anything else is a plain answer."""
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    raw = message["content"]
    if reasoning:
        content, thinking = raw, not raw.strip()
    elif THINK_CLOSE in raw or raw.lstrip().startswith(THINK_OPEN):
        (reasoning, content), thinking = split_reasoning(raw, cut=True), THINK_CLOSE not in raw
    elif open_think:
        reasoning, content, thinking = raw, "", True
    else:
        content, thinking = raw, False
    out = {k: v for k, v in message.items() if k not in ("reasoning", "reasoning_content")}
    out["content"] = content
    if reasoning:
        out["reasoning_content"] = reasoning
    return out, thinking


def served_turn(tokenizer: Any, messages: list[dict], i: int, template_kwargs: dict | None = None,
                cut: bool = False) -> ServedTurn:
    """Assistant turn ``i`` of ``messages`` (reasoning in ``reasoning_content``, see
    :func:`with_reasoning`) as the target emits it after ``messages[:i]``, rendered with
    ``template_kwargs``. ``cut``: the reply was cut by ``max_tokens``; it ends with its own text,
    without the end-of-turn marker. With a thinking template a cut reply's content may be the raw
    generated text (see :func:`_cut_reply`); one cut inside its reasoning is served as the
    generation prompt and that reasoning, ending where the text ended: no ``</think>``, no answer.

    Raises:
        TemplateError: the reply carries reasoning the template, rendered this way, gives no place
            (thinking off: the served target does not think); or the template renders the reply
            in a way that does not continue its own generation prompt and is not a think block
            left open by it (no assistant mask is possible from it).
    """
    prompt = render(tokenizer, messages[:i], template_kwargs, add_generation_prompt=True)
    m, thinking = messages[i], False
    if cut and is_thinking_template(tokenizer):
        m, thinking = _cut_reply(m, open_think=prompt.rstrip().endswith(THINK_OPEN))
        messages = [*messages[:i], m]
    reasoning, content = m.get("reasoning_content") or "", m["content"]
    through = render(tokenizer, messages[: i + 1], template_kwargs)
    kw = f" with chat_template_kwargs {template_kwargs}" if template_kwargs else ""
    unplaced = TemplateError(f"turn {i} carries reasoning (reasoning_content) that the chat template{kw} gives no "
                             "place in the served reply (thinking is off, so the served target would not write it); "
                             "regenerate the replies with these data.chat_template_kwargs or drop the reasoning")
    if through.startswith(prompt):
        reply = through[len(prompt):].rstrip()
        if reasoning.strip() and reasoning.strip() not in reply:
            empty = _EMPTY_THINK.match(reply)
            if empty is None:
                raise unplaced
            reply = THINK_OPEN + reasoning + THINK_CLOSE + reply[empty.end():]
        if cut:
            # the last text the target emitted: its reasoning when cut inside it, else its answer
            if thinking:
                mark = reasoning.strip() or THINK_OPEN
            elif content.strip():
                mark = content.rstrip()
            else:  # cut right after </think>
                mark = THINK_CLOSE if reasoning else ""
            at = reply.rfind(mark) if mark else -1
            if at < 0:
                raise TemplateError(f"the chat template rewrites the cut reply of turn {i}: its end cannot be located, "
                                    "so its end-of-turn marker cannot be left unlabelled")
            reply = reply[: at + len(mark)]
        return ServedTurn(i, prompt, reply)
    if not prompt.rstrip().endswith(THINK_OPEN):
        if reasoning.strip():
            raise unplaced
        raise TemplateError("chat template cannot produce an assistant mask: rendering the conversation up to turn "
                            f"{i} does not continue its own generation prompt (the template rewrites the reply)")
    # the prompt leaves <think> open (DeepSeek-R1, V3.1 thinking): reasoning, </think>, answer, end marker
    if thinking:  # cut inside the reasoning: what the target emitted after the prompt's <think>
        return ServedTurn(i, prompt, reasoning.rstrip())
    if cut and not content.strip():  # cut right after </think>
        return ServedTurn(i, prompt, reasoning + THINK_CLOSE)
    at = through.rfind(content) if content else -1
    if at < 0:
        raise TemplateError(f"the chat template rewrites the answer of turn {i}: it cannot be located in the rendering")
    end = "" if cut else through[at + len(content):].rstrip()
    return ServedTurn(i, prompt, reasoning + THINK_CLOSE + (content.rstrip() if cut else content) + end)
