"""finetune: config-driven fine-tuning of language models (README.md; the site under docs/)."""

import time as _time

IMPORTED = _time.time()
"""When this process imported the package: for `python -m finetune.launch` its Python start (the interpreter's own
start-up, tens of milliseconds, before it), even where the process began as a shell that `exec`ed Python
(finetune.startup.launch_times: the launcher's share of the start-up is measured from here)."""
