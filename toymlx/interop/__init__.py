"""A run's model as other tools take it: fused GGUF exports, Ollama Modelfiles, timm checkpoints."""
