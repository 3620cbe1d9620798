"""Data, in the order it flows (each module imports only those before it):

- sources.py: where rows come from: files, directories, hub ids, mixtures, streams; the train/eval split; the
  data's fingerprint. No heavy imports: the launcher reads local files through it.
- tools.py: tool calls and results in rows (OpenAI's and ShareGPT's shapes) -> the shape chat templates read.
- forms.py: row forms (alpaca, chat, sharegpt, completion, text, preference) -> conversations, pairs, text.
- templates.py: the chat template a run renders with (data.chat_template), each response's span in a rendered
  conversation (aligned, prefix-stable or not), the tools probe, reasoning blocks.
- tokenize.py: response-only labels, truncation: the helpers a method encodes a row with, the counts.
- examples.py: rows -> the run's examples through its method (finetune.methods, built on forms.py and
  tokenize.py): the launcher's check of every local row, `tokenize_row`, a split in memory.
- pack.py: several samples per row (first fit, seeded, n log n).
- batches.py: step -> this rank's micro-batches (a pure function of (seed, step)); evaluation's batches.
- cache.py: the tokenized (and packed) data as an on-disk Arrow artifact, made once, memory-mapped by every rank.
- stream.py: data.streaming=true: data.train read as it is needed and tokenized by a DataLoader worker, no cache.

Which forms a run reads and what a row becomes is the method's: examples.py asks its record, so no module
here imports finetune.methods but examples.py and those after it.
"""
