"""What the pipeline must know about a vision-language model family's image input, in one place per family.

``family.ModelFamily`` is the description every stage asks: patch, merge and temporal sizes, the resize factor,
normalisation, pixel limits, the resize rule and the grid / visual-token arithmetic. Each family is one module here
(``qwen2_vl``: Qwen2-VL and Qwen2.5-VL) that defines ``FAMILY``; ``registry`` finds a family by name or from a
checkpoint's ``config.json``, with the pixel limits of its image processor settings. Adding a family is adding
one module with a ``FAMILY``. Ground floor: nothing here imports a stage, the CLI or ``vlmstream.config``.
"""
