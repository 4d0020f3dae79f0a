"""The serving engine: requests, block manager, scheduler, model runner, sampler, engine loop."""
