"""Incremental detokenization with stop strings: text is released only when no stop string can still
begin in it, and never in the middle of a multi-byte character."""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop_strings: list[str]):
        self.tokenizer = tokenizer
        self.stops = stop_strings
        self.hold = max((len(s) for s in stop_strings), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # all text so far (cut at a stop string once one matched)
        self.sent = 0  # characters of self.text already released
        self.stopped = False  # a stop string matched

    def add(self, token_ids: list[int]) -> str:
        """Take new tokens; return the text that can be released now."""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s, max(0, self.sent - self.hold)) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = text[: min(hits)], True
            return self.flush()
        self.text = text
        end = len(text) - self.hold
        while end > self.sent and text[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence so far
            end -= 1
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent : end], end
        return out

    def flush(self) -> str:
        """The rest of the text (the request finished)."""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
