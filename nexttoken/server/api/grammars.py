"""Grammar compiles for the server: their own small thread pool, a time budget, and refusals remembered.

A compile can take half a minute (a GBNF rule of 60,000 alternatives: ~30 s here before llguidance refuses it),
and llguidance offers no time limit (its LLParserLimits bound fuel and items, not seconds) and no way to stop a
compile once begun. So compiles run on a small pool of their own (two threads: one slow compile does not hold up
the quick ones), apart from the default executor that renders chat templates and tokenizes (a plain request never
waits behind one); a request waits at most `budget_s` for its compile and is then refused (400) naming the
budget, while the compile runs on and its result, a matcher or a refusal, is cached for the next request with the
same constraint. Until then the constraint is refused at once. Compiles waiting or running are bounded: past
`max_pending` a request is refused (429) instead of queued.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from ...generation.processors.structured import (GRAMMARS, Compiled, GrammarCache, StructuredOutputError,
                                                 cached_for, compile_for, constraint_of)
from ..http.errors import APIError

RETRY_AFTER_S = 1


class GrammarCompiler:
    """One per server: `compile(cfg)` on the pool within the budget (None when cfg sets no constraint)."""

    def __init__(self, tokenizer: Any, vocab_size: int, budget_s: float, workers: int = 2, max_pending: int = 8,
                 cache: GrammarCache = GRAMMARS) -> None:
        self.tokenizer, self.vocab_size, self.budget_s, self.max_pending = tokenizer, vocab_size, budget_s, max_pending
        self.cache = cache
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self.pending: dict[tuple, concurrent.futures.Future] = {}  # (constraint key, stop ids) -> its compile

    async def compile(self, cfg: Any) -> Compiled | None:
        """The compiled constraint of `cfg`: StructuredOutputError when it cannot be enforced, or did not compile
        within the budget; APIError 429 when too many compiles are waiting."""
        constraint = constraint_of(cfg)
        if constraint is None:
            return None
        hit = cached_for(cfg, self.tokenizer, self.vocab_size, self.cache)  # a refusal: raised at once
        if hit is not None:
            return hit
        stop_ids = tuple(sorted(cfg.stop_ids))
        key = (constraint.key, stop_ids)
        job = self.pending.get(key)  # the same constraint already compiling: wait for that one
        if job is None:
            if len(self.pending) >= self.max_pending:
                raise APIError(429, f"{len(self.pending)} grammar compiles are waiting or running, the most this "
                                    "server queues; retry later", None, "rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            job = self.pool.submit(compile_for, cfg, self.tokenizer, self.vocab_size, self.cache)
            self.pending[key] = job
            job.add_done_callback(lambda _: self.pending.pop(key, None))
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job)), self.budget_s)
        except asyncio.TimeoutError:
            refusal = StructuredOutputError(
                f"{constraint.kind} did not compile within this server's budget of {self.budget_s:g} s "
                "(--grammar-compile-timeout): simplify it (fewer alternatives in one rule, a smaller enum); the "
                "compile goes on, and its result serves the same constraint later")
            lltokenizer = self.cache.built_tokenizer(self.tokenizer, self.vocab_size, stop_ids)
            if job.cancel() or lltokenizer is None:  # never started: nothing judged, nothing to remember
                raise refusal from None
            self.cache.refuse(constraint, lltokenizer, refusal, replace=False)  # until the compile's own result
            raise refusal from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
