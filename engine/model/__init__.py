"""The model and what makes it: the Llama-family decoder (``llama``), its typed config
(``config``), weights from safetensors or a GGUF file (``weights``, ``gguf_file``,
``quantized_weights``), the tokenizer, the built-in tiny model, the catalog of what a
command can serve, and the decode-step fast paths (``decode_kernel``: one C call per
step; ``compiled_decode``: ``torch.compile``). The step loop around
it (scheduler, runner, outputs) stays in ``pdserve.engine``."""
