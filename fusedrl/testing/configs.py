"""Config overrides the trainer tests share."""

# train_configs/debug_ppo.toml at a size that runs in seconds: randomly initialised debug models, 8 samples in
# micro-batches of 2, one epoch, responses of at most 10 tokens. A quarter of the vocabulary stops a response, so
# lengths vary (and a tail can migrate).
TINY_DEBUG_RUN = (
    "--generation.stop_token_ids=" + ",".join(map(str, range(0, 512, 4))),
    "--model.actor_path=",
    "--model.critic_path=",
    "--model.reward_path=",
    "--model.reference_path=",
    "--ppo.batch_size=8",
    "--ppo.minibatch_size=8",
    "--ppo.microbatch_size=2",
    "--ppo.epochs=1",
    "--generation.max_new_tokens=10",
    "--generation.max_slots=4",
    "--data.max_prompt_len=32",
)
