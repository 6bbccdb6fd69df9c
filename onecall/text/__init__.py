"""Text around the model: tokenizer, detokenizer, stop strings, chat templates, reasoning and tool-call parsing."""
