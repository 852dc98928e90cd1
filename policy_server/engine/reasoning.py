"""Reasoner calls: autoregressive text over the UND weights with a KV cache, between ticks.

A call is background work on the model worker, one prefill chunk or token per worker step, so a tick waits
for at most one of them. It never touches the diffusion cache. At most `max_reason_calls` run at once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterator

import torch

from policy_server.engine import api
from policy_server.engine.call_end import POLL_S, CallEnd
from policy_server.engine.served import ServedModel, user_text_ids
from policy_server.engine.worker import GeneratorJob, ModelWorker
from policy_server.limits import MAX_PROMPT_TOKENS
from policy_server.pipeline.reasoner import ReasonerStream


class Reasoning:
    """The reasoner calls of one engine, run as background work on its model worker."""

    def __init__(self, served: ServedModel, worker: ModelWorker):
        self.served, self.worker = served, worker
        self._calls = threading.Semaphore(served.settings.max_reason_calls)

    def reason(self, prompt: str, max_new_tokens: int, temperature: float = 0.0, seed: int | None = None,
               should_abort: Callable[[], bool] | None = None, deadline_s: float | None = None
               ) -> Generator[str, None, api.ReasonEnd]:
        """Autoregressive text over the UND weights with a KV cache; never touches the diffusion cache. The
        generator returns how the call ended."""
        tokenizer = self.served.pipeline.tokenizer
        count = len(user_text_ids(tokenizer, prompt, "prompt"))
        if count > MAX_PROMPT_TOKENS:
            raise api.InvalidArgument("prompt", f"at most {MAX_PROMPT_TOKENS} tokens", f"{count} tokens",
                                      reason="TOO_LONG")
        ids = torch.tensor(tokenizer.tokenize(tokenizer.apply_chat_template([{"role": "user", "content": prompt}])),
                           dtype=torch.long)
        stops = {tokenizer.eos_token_id, *tokenizer.special_token_ids.values()}
        max_tokens = min(max_new_tokens, self.served.settings.max_reason_tokens)
        # The place first: a refused call allocates no KV cache. Released by finish(), whatever ends the call.
        if not self._calls.acquire(blocking=False):
            raise api.TooManyReasonCalls(self.served.settings.max_reason_calls)
        try:
            stream = ReasonerStream(self.served.pipeline.transformer, ids, max_tokens, temperature=temperature,
                                    stop_token_ids=stops, seed=seed or 0)
        except BaseException:  # e.g. its KV cache does not fit beside the model: the place goes back
            self._calls.release()
            raise
        pieces: queue.Queue = queue.Queue()  # text, then the ReasonEnd or the error that ended the call

        def steps() -> Iterator[None]:
            produced: list[int] = []
            decoded = emitted = ""
            token = None
            while not stream.done:
                token = stream.step()
                if token is not None and token not in stops:
                    produced.append(token)
                    decoded = tokenizer.decode(produced)
                    # A token that ends inside a character waits for the next, which may complete it.
                    if len(decoded) > len(emitted) and not decoded.endswith("\ufffd"):
                        pieces.put(decoded[len(emitted):])
                        emitted = decoded
                yield
            if len(decoded) > len(emitted):
                pieces.put(decoded[len(emitted):])  # no next token: what is held back is the text's end
            finish(api.ReasonEnd("stop" if token in stops else "length", len(produced)))

        def finish(last: object) -> None:
            pieces.put(last)
            self._calls.release()

        end = CallEnd(self.served.closing, deadline_s, should_abort,
                      late="the caller's deadline passed during reasoning")
        job = GeneratorJob(steps(), finish, end)
        try:
            self.worker.submit(job)
        except api.ShuttingDown:
            self._calls.release()
            raise

        def stream_pieces() -> Generator[str, None, api.ReasonEnd]:
            while True:
                try:
                    item = pieces.get(timeout=POLL_S)
                except queue.Empty:
                    self.worker.end_queued(job, end)  # ticks go first: the call may wait long between its steps
                    continue
                if isinstance(item, api.ReasonEnd):
                    return item
                if isinstance(item, BaseException):
                    raise item
                yield item

        return stream_pieces()
