"""The draft's shape defaults, written once: train-draft's options (pipeline.PipelineConfig) and the
trainer's own (train.TrainConfig) both take them from here."""

AUX_LAYERS = (2, 15, 27)  # target layers fed to the draft (SmolLM2-135M: early, middle, late of 30)
DRAFT_VOCAB = 8192  # draft vocabulary size (the most frequent answer tokens)
DRAFT_FORMAT = "vllm"  # config.json of the written draft: vllm (LlamaForCausalLMEagle3) or speculators
