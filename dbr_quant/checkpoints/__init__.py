"""FP8 checkpoints in the compressed-tensors ``float-quantized`` layout (what llm-compressor writes and
transformers, vLLM and SGLang load), and back into a converted dbr_quant model.

    dbr_quant.save_pretrained(converted, "out/")                 # model-*.safetensors, config.json, dbr_quant.json
    converted = dbr_quant.load_pretrained("out/", model)         # model: the high-precision architecture

``layout`` maps a converted model to tensors and a ``quantization_config``; ``safetensors_io`` writes and
reads the files one tensor at a time; ``sidecar`` is ``dbr_quant.json``; ``save`` / ``load`` put them together.
"""

from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.checkpoints.load import load_pretrained
from dbr_quant.checkpoints.save import save_pretrained

__all__ = ["save_pretrained", "load_pretrained", "CheckpointError"]
