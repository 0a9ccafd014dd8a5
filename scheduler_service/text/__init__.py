"""Text in and out: the tokenizer (chat template), incremental detokenizer, per-request output
processing (stops, chunks) and structured output.
"""
