"""What tests/ranks.py's fork server imports once: every module a rank imports, so that a forked rank imports nothing."""

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401 - the loss plot (finetune.logs)
from matplotlib.figure import Figure  # noqa: F401

import finetune.rank.train  # noqa: F401 - torch, transformers, datasets, the engines
from finetune.rank import dist

dist.import_deepspeed()  # without its autotuner's mlflow, as a rank imports it
import peft  # noqa: E402,F401
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: E402,F401
