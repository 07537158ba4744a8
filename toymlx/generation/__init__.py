"""Forward-only use of a trained model: text generation, sampling, llama.cpp decoding, image classification."""
