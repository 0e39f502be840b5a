"""Chat for the Kimi families: encodings, output parsers (reasoning, tool calls), constrained decoding.

Modules (imports flow down this list):
    request.py            tools / tool_choice / parallel_tool_calls / response_format / reasoning_effort fields,
                          `FieldError` (a RequestError with `.param`)
    markup.py             control tokens of both families; output ids / text -> items (text, control tokens,
                          K3 tags)
    prompt.py             `Segment` (markup or request text), `ChatPrompt` (segments -> token ids), message readers
    k2_encoding.py        Kimi K2 / Kimi Linear turns as segments (`encode_k2`)
    k3_encoding.py        Kimi K3 XTML encoding as code (`encode_k3`)
    reasoning_parsers.py  `kimi_k2`, `kimi_k3`: reasoning_content apart from the rest
    tool_parsers.py       `kimi_k2`, `kimi_k3`: content and tool calls, streaming
    output.py             `ChatOutputParser`: one request's parser, OpenAI message / delta shapes
    grammar.py            llguidance grammars per request, bitmask fill and apply

How the server uses it (one chat request):

1. Parse: `treq = request.parse_tool_request(body)`; a `FieldError` is a 400 with `param=e.param`.
   (`protocol.parse_chat` must stop refusing `tools` / `response_format` and pass tool messages' `tool_calls`,
   `tool_call_id`, `reasoning_content` through.)
2. Encode: `decls = [t.declaration for t in treq.tools]`;
   kimi_k2: `prompt = encode_k2(messages, decls, add_generation_prompt=..., thinking=None | True | False)`
            (None for instruct checkpoints such as Kimi Linear Instruct; `reasoning_effort="none"` -> False);
   kimi_k3: `prompt = encode_k3(messages, decls, reasoning_effort=treq.reasoning_effort,
            tool_choice=treq.tool_choice.mode, response_format=body.get("response_format"))`.
   `ids = prompt.token_ids(tokenizer)`: each run is `tokenizer.encode(seg.text, allow_special=seg.markup)`;
   request text is only ever encoded with allow_special=False. Never `apply_chat_template` + allow_special=True.
3. Constrain: once per server `gc = GrammarCompiler(tokenizer, model_vocab_size, family, stop_ids=engine eos ids)`;
   per request `g = gc.for_request(treq, prompt)` (None: unconstrained, the request pays nothing) and, for
   tool_choice auto, `gc.check_request(treq)` so a schema llguidance cannot compile is a 400 too. Per decode step,
   for the batch's rows: `any_ = fill_bitmasks([g_or_None per row], host_bitmask)` (host int32
   [B, ceil(V/32)] from `allocate_bitmask`, bit 1 = allowed, rows without a grammar all ones); if `any_`, copy it
   to the device and `apply_bitmask_(logits, device_bitmask)` before sampling (or a fused kernel checked against
   it); after sampling, `g.accept(token)` for each constrained row. Ids past the tokenizer are never allowed.
   A grammar ends at the end of the constrained output: only the stop ids (`stop_ids`) are allowed next, so the
   engine's stop condition ends the request.
4. Parse the output: `parser = ChatOutputParser(family, tokenizer, reasoning=<--reasoning-parser set>,
   tools=<tools declared and tool_choice != "none">, starts_in_reasoning=prompt.opens_reasoning)`.
   Streaming: `parser.feed_ids(new_ids)` -> list of delta dicts, each one of
       {"reasoning_content": str} | {"content": str} |
       {"tool_calls": [{"index": i, "id": ..., "type": "function", "function": {"name": ..., "arguments": ""}}]}
       (first chunk of a call: name once) | {"tool_calls": [{"index": i, "function": {"arguments": fragment}}]},
   then `parser.finish()` at the end; each becomes `choices[0].delta` of a chunk (role on the first).
   Non-streaming: feed everything, `finish()`, `parser.message()` ->
       {"role": "assistant", "content": str | None, "reasoning_content": str (if any),
        "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": JSON string}}] (if any)}.
   `parser.finish_reason(engine_reason)` -> "tool_calls" when calls were made and the model stopped, else the
   engine's reason ("length" stays "length"). Feed the ids with the engine's stop token included or not: control
   tokens carry no text. The usual detokenizer is not used for chat outputs with a parser.
"""
