"""Training an EAGLE-3 draft for a target model on CPU (``dynamo-spec train-draft``).

Modules, one job each: ``data`` (prompts from PyPI packages), ``answers`` (the
target's greedy answers with vLLM), ``hidden_states`` (aux + final hidden states with
transformers), ``vocab`` (draft vocabulary and ``d2t``), ``model`` (draft head and
training-time-test loss), ``train`` (the loop), ``pipeline`` (the stages in order),
``evaluate`` (``eval-draft``), ``engine`` (a short-lived offline vLLM engine), ``cli``.
"""
