"""The batch columns each worker method reads, declared on the method (``register``'s ``batch_keys`` and
``non_tensor_batch_keys``): the driver sends a method only these, so a call moves the sequences and that method's
own inputs, not every column the step has gathered (scores, rewards, returns, entropies, prompt text, ground
truths). Each list is a superset: a column some config adds (``ref_log_prob`` with a KL loss, ``rollout_log_probs``
for AIPO or truncated IS, ``truncated`` for the overlong filter) is listed, and skipped where the batch lacks it.
"""

#: the token sequences every forward reads: (B, P + R) ids, mask, positions; (B, R) responses and their mask; a
#: VLM's (B, 3, P + R) mrope positions (hybridflow/models/vlm.py)
SEQUENCE = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "mrope_position_ids")
#: the actor's own forwards (old logprobs): the sequences and an MoE rollout's routing (actor.router_replay=rollout)
ACTOR_SEQUENCE = SEQUENCE + ("routed_experts",)
#: the actor's update: the sequences, the PPO inputs and what the loss options read
ACTOR_UPDATE = ACTOR_SEQUENCE + ("old_log_probs", "advantages", "ref_log_prob", "rollout_log_probs", "truncated")
#: the critic's update: the sequences, the values before the update (value clipping) and the returns
CRITIC_UPDATE = SEQUENCE + ("values", "returns")
#: a rule reward or cost decodes the responses; its scoring function gets every non-tensor column
RESPONSES = ("responses", "response_mask")
#: methods that read no non-tensor column (ids, texts, ground truths stay on the driver)
NONE = ()
#: the non-tensor columns a sequence forward reads: a VLM row's images (``pixel_values``, ``image_grid_thw``)
MODEL_INPUTS = ("multi_modal_inputs",)
