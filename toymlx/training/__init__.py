"""The training loop every recipe shares: the step, CPU streams, schedule, memory estimate, LoRA adapter files and fused exports."""
