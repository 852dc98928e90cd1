"""Diffusion step caching at the GEN-stack boundary: SeaCache and the no-cache baseline."""

from .controller import CacheRecord, NoCache, StepController, StepDecision
from .sea_filter import SeaFilter
from .seacache import SeaCache, SeaCacheConfig

__all__ = ["CacheRecord", "NoCache", "SeaCache", "SeaCacheConfig", "SeaFilter", "StepController", "StepDecision"]
