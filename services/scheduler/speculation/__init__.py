"""Speculative decoding in the scheduler (moved from speculation.py; split by job next)."""

from strata.services.scheduler.speculation.proposals import (  # noqa: F401
    NGRAM_RETRY_TOKENS,
    Acceptance,
    AdaptiveK,
    CostModel,
    SpecState,
    Speculation,
    SpeculativeConfig,
    drafts_that_fit,
    expected_tokens,
    rollback,
)
