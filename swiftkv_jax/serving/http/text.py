"""Token ids to text while they stream in: incremental detokenization and stop strings.

`Detokenizer` decodes a short window of tokens each time (vLLM's prefix/read offsets), so a token costs the same
however long the output, and it holds text back while it ends in an incomplete UTF-8 sequence (U+FFFD): no
character is ever sent in pieces. The window starts on the prompt's last tokens, so a tokenizer that drops the
leading space of a decoded sequence (SentencePiece) still gives the first output token its space.

`ChoiceText` is one choice's text: the detokenizer, the stop strings (the text is cut before the first one found,
or after it with vLLM's include_stop_str_in_output, and the choice ends with finish_reason "stop"; with vLLM's
min_tokens, one that ends in the text of the first min_tokens tokens does not count), and a hold-back of any tail that
could still become a stop string (none when the stop string stays in the text: what is sent stays either way).

vLLM's `skip_special_tokens` (default true) and `spaces_between_special_tokens` (default true) go to the tokenizer's
decode (`Detokenizer`): transformers' slow tokenizers honour both, its fast ones (tokenizers' decoders) the first and
take the second without effect, as vLLM's fast detokenizer, which writes no space between special tokens either way.
"""

from __future__ import annotations

from typing import Optional, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6  # prompt tokens the first window starts on


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        # decode's options: the second only when it is not the default, which every tokenizer has
        self.options = dict(skip_special_tokens=skip_special_tokens)
        if not spaces_between_special_tokens:
            self.options["spaces_between_special_tokens"] = False
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []  # the prompt ends inside a character: its bytes would fuse with the output's
        self.ids = context
        self.prefix = 0              # the window decoded is ids[prefix:]
        self.read = len(context)     # ids[prefix:read] is text already given out

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, **self.options)

    def push(self, token_ids: Sequence[int]) -> str:
        """The new text that `token_ids` complete (possibly ''): never ends inside a character."""
        self.ids.extend(int(t) for t in token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is held back, complete or not (the output has ended)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) > len(before) and (final or not text.endswith(REPLACEMENT)):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before):]
        return ""


class ChoiceText:
    """One choice's text as its tokens arrive. `add` returns the text that may be sent now; `stopped` is set once a
    stop string appears (the text ends before it, and later tokens are ignored). min_tokens: a stop string must end
    past the text of the first min_tokens tokens (vLLM's detokenizer checks none before; one may begin there).
    include_stop: the text ends after the stop string instead (vLLM's include_stop_str_in_output); `decode`: the
    detokenizer's skip_special_tokens and spaces_between_special_tokens."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (), min_tokens: int = 0,
                 include_stop: bool = False, **decode):
        self.detokenizer = Detokenizer(tokenizer, prompt_ids, **decode)
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.longest = max((len(s) for s in self.stop), default=0)
        # The text so far is `_parts` + `window`. The window holds what is not given out yet and, before it, the
        # last longest - 1 characters given out (where a stop string could still begin); older text goes to
        # `_parts`, joined once by `text`. So a token costs its own characters, however long the output.
        self._parts: list[str] = []
        self.window = ""
        self.sent = 0        # characters of `window` given out
        self.stopped = False
        self.min_tokens, self.tokens = min_tokens, 0
        self._base = 0       # characters in `_parts`
        self._unchecked = 0  # characters of the text (from its start) in which no stop string may end

    @property
    def text(self) -> str:
        """All the text so far (sent + held back)."""
        return "".join(self._parts) + self.window

    def add(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        head = max(0, min(len(token_ids), self.min_tokens - self.tokens))  # of the first min_tokens: unchecked
        self.tokens += len(token_ids)
        out = self._extend(self.detokenizer.push(token_ids[:head]), final=False, checked=False) if head else ""
        if head < len(token_ids) or not head:
            out += self._extend(self.detokenizer.push(token_ids[head:]), final=False)
        return out

    def finish(self) -> str:
        """The rest of the text, once the engine has finished the request."""
        if self.stopped:
            return ""
        return self._extend(self.detokenizer.flush(), final=True, checked=self.tokens > self.min_tokens)

    def _extend(self, delta: str, final: bool, checked: bool = True) -> str:
        window = self.window
        start = max(0, len(window) - self.longest + 1)  # where a stop string could first end in the new text
        window += delta
        if not checked:  # the text of the first min_tokens tokens
            self._unchecked = self._base + len(window)
        cut = self._find_stop(window, start)
        if cut is not None:
            window, self.stopped = window[:cut[0] + (len(cut[1]) if self.include_stop else 0)], True
            final = True
        end = len(window) if final else len(window) - self._hold_back(window)
        out = window[self.sent:end]
        self.sent = max(self.sent, end)
        done = max(0, self.sent - max(self.longest - 1, 0))  # given out, and out of every stop string's reach
        if done:
            self._parts.append(window[:done])
            window, self.sent, self._base = window[done:], self.sent - done, self._base + done
        self.window = window
        return out

    def _find_stop(self, text: str, start: int) -> Optional[tuple[int, str]]:
        """(where the first stop string in `text` begins, which one), or None."""
        floor = self._unchecked - self._base  # a stop string ends past it: begins at floor - len + 1 or later
        found = [(i, s) for s in self.stop for i in [text.find(s, max(start, floor - len(s) + 1))] if i >= 0]
        return min(found, key=lambda f: f[0]) if found else None

    def _hold_back(self, text: str) -> int:
        # a stop string that stays in the text needs no hold-back: its characters are sent either way (vLLM's)
        return 0 if self.include_stop else held_back(text, self.stop)


def held_back(text: str, strings: Sequence[str]) -> int:
    """Length of the longest tail of `text` that begins one of `strings` (and so must not be sent yet)."""
    best, end = 0, len(text)
    for s in strings:  # a tail can begin only where s's first character is: its only candidates, longest first
        i = text.find(s[0], end - min(len(s) - 1, end))
        while 0 <= i < end - best:
            if s.startswith(text[i:]):
                best = end - i
                break
            i = text.find(s[0], i + 1)
    return best
