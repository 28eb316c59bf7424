"""Training an EAGLE-3 drafter, the pieces eaglenest.stages.train puts together.

    batches       packed rows of the consolidated shards, read ahead and moved to the device
    target_head   the target's distribution over the draft vocab (soft labels), in-draft test
    objective     the training-time-test (TTT) unroll and its loss
    draft_loss    one TTT step's loss through the drafter's head, its gradient formed at once
    checkpoints   checkpoint files, their checksums, RNG states, which one to resume from
    loop          one optimizer step, validation, the loop over the steps
    launch        devices, processes and torchrun (DDP)
"""
