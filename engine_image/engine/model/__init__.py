"""Model code (torch): Llama-family decoder, paged attention, loaders, tokenizer."""
