"""The on-disk formats, under both training and inference: run directories and the ``latest``
pointer (:mod:`.files`), tensor-parallel sharding math (:mod:`.sharding`), and weights readable
without a model (:mod:`.weights`). Nothing here imports the model, the trainer or DeepSpeed."""
