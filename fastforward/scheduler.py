"""Continuous batching over a token budget, with no prefill or decode phase.

Every request only tracks ``num_computed_tokens``. Each step a scheduled request computes
``min(num_tokens - num_computed_tokens, remaining budget)`` tokens, so a whole prompt, a chunk of
one, one decode token and a recompute after preemption are the same rule.

Order of a step: running requests first, oldest first; when blocks run out the newest running
request is preempted (blocks freed, recomputed later from scratch with its output kept) and put
at the front of the waiting queue. Only in a step without preemption are waiting requests
admitted, in FCFS order, stopping at the first that does not fit.

Prefix caching: a request is admitted with the longest cached prefix of its tokens already
computed (``num_computed_tokens`` starts there) and computes the rest. Blocks enter the cache in
``update``, after the step that filled them; a waiting request whose next block is being filled
in the current step by another request (a sibling of ``n > 1``, the same system prompt arriving
together) waits for the next step and hits it instead of computing it again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from fastforward.config import SchedulerConfig
from fastforward.kv.manager import KVCacheManager
from fastforward.request import Request, RequestStatus
from fastforward.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot of the scheduler for logging and ``/metrics``."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int  # since start
    # Prefix cache, in tokens since start: tokens of admitted requests looked up, and how many
    # of them were served from the cache (readmissions after preemption included).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Speculative decoding since start: request-steps that verified drafts, drafts verified,
    # drafts accepted.
    spec_verifications: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens gained per verification: accepted drafts plus the one the target adds."""
        if not self.spec_verifications:
            return 0.0
        return 1.0 + self.spec_accepted_tokens / self.spec_verifications

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class Scheduler:
    """Owns the waiting and running queues and decides what each engine step computes."""

    def __init__(self, scheduler_config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = scheduler_config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Speculative decoding since start: verification steps, drafts verified, accepted.
        self.num_spec_verifications = 0
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue ``request``; ValueError if it is malformed or could never fit the KV cache."""
        self._validate(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _validate(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt must contain at least one token")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        max_len = self.config.max_model_len
        if request.num_prompt_tokens > max_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, max_model_len is {max_len}"
            )
        needed = self.kv.num_blocks_needed(self.max_kv_tokens(request))
        if needed > self.kv.pool.num_usable_blocks:
            raise ValueError(
                f"request needs up to {needed} KV blocks, the cache holds "
                f"{self.kv.pool.num_usable_blocks}; lower max_tokens or enlarge the cache"
            )

    def max_kv_tokens(self, request: Request) -> int:
        """The most tokens ``request`` will ever hold in the KV cache.

        The last token generated is never computed, so a request that ends with ``n`` tokens
        has cached at most ``n - 1``; a prompt is always cached whole.
        """
        last = min(request.num_prompt_tokens + request.max_tokens, self.config.max_model_len)
        return max(request.num_prompt_tokens, last - 1)

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus
    ) -> list[Request]:
        """End the given requests wherever they are; unknown or finished ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                self._finish(request, status)
                finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        request.finished_time = time.time()
        del self.requests[request.request_id]

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick the requests and token counts of the next step and allocate their KV blocks."""
        output = SchedulerOutput()
        self.kv.begin_step()
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        if not output.preempted:
            self._schedule_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n <= 0:  # nothing to compute until it gets a token; not expected
                i += 1
                continue
            k = self._num_spec_tokens(request, n, budget)
            if not self._allocate_or_preempt(request, n + k, output.preempted):
                break  # the request itself was preempted: everything after it already was
            output.scheduled.append(self._scheduled(request, n + k, k))
            budget -= n + k
            i += 1
        return budget

    def _num_spec_tokens(self, request: Request, n: int, budget: int) -> int:
        """Draft tokens to verify with this step's last known token: the request's drafts,
        cut to the budget left (and to none while it still has a prompt chunk to compute)."""
        drafts = request.spec_token_ids
        if not drafts:
            return 0
        k = min(len(drafts), budget - n) if n == 1 else 0
        if k < len(drafts):
            request.spec_token_ids = drafts[:k]
            if request.spec_draft_probs is not None:
                request.spec_draft_probs = request.spec_draft_probs[:k] if k else None
        return k

    def _allocate_or_preempt(self, request: Request, n: int, preempted: list[Request]) -> bool:
        """Allocate for ``request``, preempting the newest running requests until it fits.

        Returns False when ``request`` itself had to be preempted. Requests scheduled earlier in
        this step are older than ``request``, so they are never the victim.
        """
        while not self.kv.allocate_slots(request, n):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        # Recompute, not swap: drop its KV and prefill prompt + output again when readmitted.
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.clear_drafts()
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)  # oldest-preempted ends up first: age order is kept

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = self.kv.find_cached_prefix(request)
            if self.kv.waits_for_pending(request, hit):
                break  # FCFS: the head waits one step for its prefix, and so does everyone
            n = min(request.num_tokens - hit.num_tokens, budget)
            if not self.kv.allocate_slots(request, n, hit):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.num_computed_tokens = hit.num_tokens
            self._record_hit(request, hit.num_tokens)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            self.running.append(request)
            output.scheduled.append(self._scheduled(request, n))
            budget -= n

    def _record_hit(self, request: Request, num_hit: int) -> None:
        if request.first_scheduled_time is None:  # first admission: only prompt tokens so far
            request.num_cached_tokens = num_hit
        if self.kv.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit

    def _scheduled(self, request: Request, n: int, num_spec: int = 0) -> ScheduledRequest:
        return ScheduledRequest(request, n, self.kv.get_block_ids(request), num_spec)

    # ---- after the step --------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Request]:
        """Record a finished step: advance progress, append sampled tokens, check stops.

        ``sampled`` maps request id to the token picked for every ``ScheduledRequest.sample``,
        or for a speculating request to its accepted drafts followed by one more token.
        Rejected drafts are taken back: their positions count as not computed (their KV is
        overwritten later) and blocks holding only them go back to the pool. Tokens after one
        that stops the request are dropped. Returns the requests that got a token (finished
        ones included, with their status set).
        """
        # Requests aborted between schedule() and update() are skipped. `sample` is read before
        # num_computed_tokens advances, since it is computed from it.
        live = [(s, s.sample) for s in output.scheduled if not s.request.is_finished]
        missing = [
            s.request.request_id
            for s, sample in live
            if sample and s.request.request_id not in sampled
        ]
        if missing:  # checked before changing anything, so a bad call leaves no half-step
            raise KeyError(f"no sampled token for requests {missing}")
        changed = []
        for s, sample in live:
            request = s.request
            tokens = sampled[request.request_id] if sample else []
            tokens = [tokens] if isinstance(tokens, int) else tokens
            if s.num_spec_tokens:
                accepted = len(tokens) - 1
                if not 0 <= accepted <= s.num_spec_tokens:
                    raise ValueError(
                        f"request {request.request_id!r}: {len(tokens)} tokens for "
                        f"{s.num_spec_tokens} drafts"
                    )
                request.num_draft_tokens += s.num_spec_tokens
                request.num_spec_steps += 1
                request.num_accepted_tokens += accepted
                self.num_spec_draft_tokens += s.num_spec_tokens
                self.num_spec_accepted_tokens += accepted
                self.num_spec_verifications += 1
                request.num_computed_tokens += s.num_new_tokens - s.num_spec_tokens + accepted
            else:
                request.num_computed_tokens += s.num_new_tokens
            request.clear_drafts()
            self.kv.cache_blocks(request)  # before a stop can free its blocks
            for token_id in tokens:
                self._append_token(request, token_id)
                if request.is_finished:
                    break
            if not request.is_finished:  # slots of rejected or unscheduled drafts
                self.kv.trim(request)
            if sample:
                changed.append(request)
        return changed

    def _append_token(self, request: Request, token_id: int) -> None:
        request.append_token(token_id)
        if request.first_token_time is None:
            request.first_token_time = time.time()
        status = self._check_stop(request, token_id)
        if status is not None:
            self._finish(request, status)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        """Stop tokens win over length limits, so a reply that ended naturally says "stop"."""
        params = request.sampling_params
        # min_tokens holds back both EOS and stop_token_ids, as in vLLM.
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- introspection ---------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            spec_verifications=self.num_spec_verifications,
            spec_draft_tokens=self.num_spec_draft_tokens,
            spec_accepted_tokens=self.num_spec_accepted_tokens,
        )
