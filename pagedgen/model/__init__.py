"""Model definitions and checkpoint loading (Hugging Face layout: config.json + safetensors)."""
