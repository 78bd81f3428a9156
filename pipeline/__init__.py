"""The data pipeline: epoch plans, block tasks on the cluster, bounded prefetch."""

from dasktrain.pipeline.errors import PipelineError
from dasktrain.pipeline.loader import Pipeline
from dasktrain.pipeline.named import NamedBatch
from dasktrain.pipeline.plan import EpochPlan
from dasktrain.pipeline.stats import PipelineStats

__all__ = ["EpochPlan", "NamedBatch", "Pipeline", "PipelineError", "PipelineStats"]
