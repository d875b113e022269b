"""Several processes under torchrun: the process group (process), the ("dp", "cp") device mesh (mesh), what each
rank holds of a batch (sharding), collectives (reductions), DDP's training forward (data_parallel) and ring
attention over our flash kernel (ring_attention), with its plan of launches and transfers under the masks
(ring_plan)."""
