"""Engine core: requests, paged KV pool, runner, sampler, prefill/decode workers. No Ray imports."""
