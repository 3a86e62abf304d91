"""Model implementations (Llama family, Qwen2/2.5, Qwen3) and their loaders."""
