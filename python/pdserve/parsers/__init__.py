"""What a chat model's raw output text means: tool calls and a reasoning part, each in its model
family's own format (SGLang's parser names), parsed whole or incrementally while it streams.

Pure text in, typed results out: no HTTP, no tokenizer, no engine. The OpenAI routes
(``entrypoints/openai_api.py``) pick the parsers per request and render the results.
"""
