"""Retro's retrieval database, read and written the same way by every tool.

`mg-prep retro` builds a project folder (`--retro-project-dir`): the chunk
database, BERT embeddings of its chunks, a Faiss index and the neighbours of
every pretraining chunk. What the trainer and the evaluator also need to read
lives here, not in the tool that writes it:

- :mod:`.files` — atomic numpy/JSON writes, so an interrupted run leaves only
  complete files behind;
- :mod:`.project` — the folder's layout and the fingerprints that tie each
  stage's output to the database it was made from;
- :mod:`.chunk_db` — the chunk table and a chunk's tokens (a neighbour and its
  continuation);
- :mod:`.bert_embedder` — a BERT checkpoint as a text embedder (mean of the
  last hidden states between [CLS] and [SEP], as Megatron's embedder);
- :mod:`.faiss_index` — the project's index, opened and searched (Faiss lazily);
- :mod:`.retrieval` — a prompt's chunks embedded and searched at generation time,
  their neighbours read as training reads them;
- :mod:`.generation` — greedy Retro generation with that retrieval.
"""
