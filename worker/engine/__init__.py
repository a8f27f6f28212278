"""The engine: one model, many sessions, batched steps (schedule -> execute -> update).

    from worker.engine import Engine
    eng = Engine.load(model=None, device="auto", max_sessions=8, max_context=2048)
"""

from worker.engine.core import Chunk, Engine, Generation
from worker.engine.sampling import SamplingParams

__all__ = ["Chunk", "Engine", "Generation", "SamplingParams"]
