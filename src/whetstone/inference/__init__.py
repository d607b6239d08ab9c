"""Inference: a continuous-batching engine over the whetstone model (logprobs, routed experts and
weight version per token, interactive/batch priorities, hot weight swap) and its
OpenAI-compatible server. See docs/inference.md.

    from whetstone.inference.config import EngineConfig
    from whetstone.inference.engine import Engine
    from whetstone.inference.sampling import SamplingParams
    engine = Engine(model, EngineConfig(max_batch=16), eos_token_ids=..., decode=tokenizer.decode)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=64, seed=0))   # offline, this thread
    engine.start(); engine.add(sequence); engine.update_weights(update)      # serving, own thread

Nothing is imported here, so `whetstone --help` does not pay for torch.
"""
