"""The draft that learns from the traffic it serves (settings: ``learning``).

- capture (opt-in): every finished request's prompt and answer tokens, kept private under
  ``learning.dir/captures`` (``capture.py``, ``captures.py``; erase: ``DELETE /admin/learning/captures``);
- learn: ``dynamo-spec learn-draft`` fine-tunes the served draft on the captures (``learn.py``);
- gate: a new version is promoted only when it beats the served draft on held-out captures and
  holds the everyday set (``gate.py``);
- swap: ``POST /admin/draft`` loads a draft into the running engine (``swap.py``, ``draft_admin.py``).
- auto: ``learning.auto`` runs the cycles in the server and swaps what they promote (``auto.py``,
  ``GET /admin/learning``: ``auto_admin.py``); replicas: ``dynamo-spec swap-draft`` (``swap_draft.py``)
  after one learn job (``deploy/k8s/learning``).
"""
