"""The Tandem engine: scheduler, paged KV cache and (with torch) the model runner."""
