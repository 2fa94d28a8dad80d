"""Typed configuration schema: every key has a type, a default and one line of doc.

Key names follow verl where verl has the same concept (``data.train_batch_size``,
``actor_rollout_ref.actor.ppo_mini_batch_size``, ``algorithm.adv_estimator`` ...), so recipes port
easily. Differences from verl are noted on the key. Batch sizes are counted in prompts for
``data.train_batch_size`` and ``*.ppo_mini_batch_size`` (as in verl) and in sequences for
``*micro_batch_size_per_gpu`` ("per gpu" means per rank; on CPU a rank is a process).

The YAML recipes in ``hybridflow/recipes`` are deltas on these defaults; ``hybridflow.config.load_config``
merges a recipe and ``key=value`` overrides into this schema and rejects unknown keys and wrong types.

Registry entries bring their own keys (:mod:`hybridflow.config.assemble`): a policy loss's, a driver's, a rollout
backend's, and each training engine's sub-section of the role sections (``fsdp_config`` from
:mod:`hybridflow.training.fsdp2_config`, ``megatron`` from :mod:`hybridflow.training.megatron_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class OptimConfig:
    lr: float = 1e-5  # peak learning rate
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    # linear warmup W (-1: lr_warmup_steps_ratio): the k-th applied update uses lr * k / (W + 1) for k <= W and the
    # full lr from update W + 1 on; the schedule counts training steps with an applied update (a step whose every
    # optimizer update the non-finite guard skipped does not advance it)
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0  # warmup W as a fraction of the total training steps (rounded down)
    lr_scheduler_type: str = "constant"  # constant | cosine (after warmup)
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr


@dataclass
class ModelConfig:
    path: str = "builtin:tiny-arith"  # local HF model directory, or builtin:tiny-arith (shipped with hybridflow)
    tokenizer_path: Optional[str] = None  # defaults to path
    # auto: bf16 on GPU; on CPU bf16 compute over fp32 master weights when a start-up matmul probe finds bf16 faster,
    # else fp32 (docs/performance.md) | float32 | bfloat16 | float16 (models that are not trained: reward, cost)
    dtype: str = "auto"
    # padding-free training forwards: a micro-batch's valid tokens packed into one row (verl's key; actor, reference,
    # critic and reward/cost models read their own section's)
    use_remove_padding: bool = False
    enable_gradient_checkpointing: bool = False  # recompute activations in backward
    # vision-language models (Qwen2/2.5-VL): keep the vision tower's weights fixed (no gradients, no optimizer state;
    # docs/how-to/vision-language.md); ignored by text models
    freeze_vision_tower: bool = False
    trust_remote_code: bool = False  # passed to transformers
    # LoRA through peft (Hu et al. 2021; docs/how-to/lora.md); for actor_rollout_ref.model and critic.model
    lora_rank: int = 0  # LoRA rank r; 0 = off (full fine-tuning). > 0: only the adapters train, the base is frozen
    lora_alpha: float = 16.0  # LoRA alpha: the adapted weight is W + (lora_alpha / lora_rank) * B A
    target_modules: Any = "all-linear"  # modules given adapters: all-linear (every Linear but the output head) | [names]
    exclude_modules: Optional[list[str]] = None  # module names (peft matching) left without adapters; null = none
    lora_dropout: float = 0.0  # dropout on the adapter input (training forward only)


@dataclass
class ActorConfig:
    strategy: str = "fsdp2"  # training-engine registry name (hybridflow.training): fsdp2 (FSDP2 + DTensor tp)
    ppo_mini_batch_size: int = 16  # prompts per optimizer step (multiplied by rollout.n, as in verl)
    ppo_micro_batch_size_per_gpu: int = 8  # sequences per forward/backward on one rank
    # micro-batches by a token budget instead of a sequence count (actor update, old and reference logprobs)
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384  # use_dynamic_bsz: valid tokens per update micro-batch on one rank
    ppo_epochs: int = 1  # passes over the rollout batch per step
    shuffle: bool = False  # shuffle the batch before splitting into mini-batches
    clip_ratio: float = 0.2  # PPO clip epsilon (used for low and high when those are unset)
    clip_ratio_low: Optional[float] = None  # lower clip epsilon (asymmetric clipping)
    clip_ratio_high: Optional[float] = None  # upper clip epsilon (asymmetric clipping)
    clip_ratio_c: float = 3.0  # dual-clip constant c > 1 for negative advantages (Ye et al. 2020)
    # policy-loss registry name; a loss's own keys (aipo_rho, icepop_alpha ...) join this section from its registration
    policy_loss: str = "vanilla"
    # truncated importance sampling: weight vanilla/gspo token losses by min(exp(old - rollout logprob), cap); <= 0 off
    tis_imp_ratio_cap: float = -1.0
    # the ratio TIS truncates: token (min(rho_t, cap) per token) | sequence (Seq-TIS: min(prod_t rho_t, cap) on every
    # token of the response), rho = pi_old / mu (verl: algorithm.rollout_correction.rollout_is)
    tis_level: str = "token"
    # masked importance sampling (MIS) of the rollout/trainer mismatch rho = pi_old / mu: null (off) | token |
    # sequence (prod_t rho_t) | geometric (exp(mean_t log rho_t)); a token (a whole response at sequence/geometric
    # level) whose ratio leaves [rollout_rs_threshold_lower, rollout_rs_threshold] is masked out of the policy loss
    # (weight 0, not clipped; every policy loss). verl's algorithm.rollout_correction.rollout_rs (its rejection sampling)
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[float] = None  # MIS upper bound on rho; null = 2.0 (verl's rollout_is_threshold)
    rollout_rs_threshold_lower: Optional[float] = None  # MIS lower bound on rho; null = 1 / rollout_rs_threshold (verl)
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    # the constant L of seq-mean-token-sum-norm (Dr. GRPO): per-sequence token sums are divided by L; null means
    # data.max_response_length (never the padded width of a batch)
    loss_scale_factor: Optional[float] = None
    # DAPO overlong filtering: responses that hit data.max_response_length without an eos leave the actor loss
    # (its numerator and its token/sequence counts)
    overlong_filter: bool = False
    entropy_coeff: float = 0.0  # entropy bonus coefficient
    # mixture-of-experts models: coefficient of the router's load-balancing loss (Switch Transformer, as transformers'
    # router_aux_loss_coef) added to the actor loss; 0 = off (the term and the expert-load metrics are still logged)
    router_aux_loss_coef: float = 0.0
    # mixture-of-experts routing replay: off (every forward routes by its own top-k) | rollout (the rollout records
    # each token's experts; the actor's old-logprob and update forwards route each token to them; the reference and
    # critic route by their own top-k) | recompute (the update's forwards replay the routing of the actor's
    # old-logprob forward; fsdp2 only); strategy=megatron replays through megatron-core's router replay;
    # docs/how-to/moe.md
    router_replay: str = "off"
    use_kl_loss: bool = False  # add KL(actor || reference) to the actor loss (GRPO style)
    kl_loss_coef: float = 0.001  # coefficient of the KL loss
    kl_loss_type: str = "low_var_kl"  # kl estimator for the KL loss: kl | abs | mse | low_var_kl
    grad_clip: float = 1.0  # max global grad norm
    # training tensor-parallel size (DTensor, inside FSDP2 over dp = ranks / tp); verl keeps it under megatron.*
    tensor_model_parallel_size: int = 1
    # Ulysses sequence parallelism (fsdp2): ranks per dp group that share a batch and split each sequence (dp =
    # ranks / sp); activation memory per rank ~1/sp (docs/how-to/long-sequences.md)
    ulysses_sequence_parallel_size: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class SamplingConfig:
    do_sample: bool = False  # greedy when false
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # nucleus sampling: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1  # -1 disables top-k
    n: int = 1  # samples per prompt
    # validation with n >= 2 samples: a response counts as correct in val/pass@k when its score is >= this (the
    # built-in rule rewards give 1.0 to a right answer)
    pass_threshold: float = 1.0


@dataclass
class MultiTurnConfig:
    # multi-turn, tool-calling rollouts (hybridflow.rollout.multi_turn; docs/how-to/multi-turn.md)
    enable: bool = False  # run the multi-turn loop over the rollout backend; needs a tokenizer with a chat template
    max_assistant_turns: int = 5  # model turns per trajectory (a tool call at the last one ends it: max_turns)
    max_user_turns: int = 5  # observation (tool-response) turns per trajectory
    # tokens one model turn may sample; null = what is left of data.max_response_length (the whole-response budget)
    max_tokens_per_turn: Optional[int] = None
    tool_config_path: Optional[str] = None  # YAML listing the tools (hybridflow/tools/config.py); null = calculator
    format: str = "hermes"  # tool-call format registry name (hybridflow.tools.formats): hermes = <tool_call>{json}
    tool_timeout_s: float = 10.0  # seconds a tool call may take before it becomes an error observation
    max_tool_response_length: int = 256  # characters of a tool result kept in its observation


@dataclass
class RolloutConfig:
    # the settings every backend reads; a backend's own keys (vllm: gpu_memory_utilization, enforce_eager, ...)
    # join this section from its registration's config dataclass (hybridflow/rollout/vllm_config.py)
    name: str = "hf"  # rollout backend registry name: hf | vllm
    n: int = 1  # samples per prompt
    do_sample: bool = True  # sample (false: greedy decoding)
    temperature: float = 1.0  # logits are divided by it before sampling
    top_p: float = 1.0  # nucleus sampling: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1  # -1 disables top-k
    log_prob_micro_batch_size_per_gpu: int = 16  # sequences per forward when recomputing logprobs
    log_prob_max_token_len_per_gpu: int = 16384  # actor.use_dynamic_bsz: valid tokens per old-logprob forward
    micro_batch_size_per_gpu: int = 64  # prompts per generate() call on one rank
    # hf rollout: decode Llama-family models (llama, mistral, qwen2, qwen3) with hybridflow's lean forward and KV
    # cache (same logits, fewer operators: hybridflow/rollout/fast_decode.py); false = transformers' forward
    fast_decode: bool = True
    tensor_model_parallel_size: int = 1  # generation tp_g (dp_g = ranks / tp_g); the 3D-HybridEngine reshards
    update_weights_bucket_megabytes: int = 64  # bound on the bytes a rank sends + receives per reshard bucket
    # with model.lora_rank > 0, what reaches the rollout after an update: merged (W + (alpha/r) B A, full weights,
    # any backend) | adapter (A and B only, far fewer bytes; hf and vllm rollouts and async generators, not int8)
    lora_sync: str = "merged"
    # validation always runs a greedy pass (val/score); with val_kwargs.do_sample it also runs a sampled pass
    # with these settings and logs val/mean@<n>, and with n >= 2 val/pass@k, val/best@k (k = 2, 4, ..., n) and
    # val/maj@<n> (docs/concepts/rollout.md)
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 16  # sequences per forward for reference logprobs
    log_prob_max_token_len_per_gpu: int = 16384  # actor.use_dynamic_bsz: valid tokens per reference forward
    # the reference runs on the actor's layout: 1 (follow the actor's) or the actor's ulysses_sequence_parallel_size
    ulysses_sequence_parallel_size: int = 1


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # None: enabled when the advantage estimator needs values (gae)
    strategy: str = "fsdp2"  # training-engine registry name (hybridflow.training) of the value model(s)
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=""))  # "" means the actor's model path
    ppo_mini_batch_size: int = 16  # prompts per optimizer step (multiplied by rollout.n)
    ppo_micro_batch_size_per_gpu: int = 8  # sequences per forward/backward on one rank
    forward_micro_batch_size_per_gpu: int = 16  # sequences per forward when computing values
    use_dynamic_bsz: bool = False  # micro-batches by a token budget instead of a sequence count (values, update)
    ppo_max_token_len_per_gpu: int = 32768  # use_dynamic_bsz: valid tokens per update micro-batch on one rank
    forward_max_token_len_per_gpu: int = 32768  # use_dynamic_bsz: valid tokens per value forward on one rank
    ppo_epochs: int = 1  # passes over the rollout batch per step
    shuffle: bool = False  # shuffle the batch before splitting into mini-batches
    cliprange_value: float = 0.5  # value clipping range
    loss_agg_mode: str = "token-mean"  # how the value loss is averaged (the actor's modes)
    grad_clip: float = 1.0  # max global grad norm
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ulysses_sequence_parallel_size: int = 1  # Ulysses sp of the value model (as actor.ulysses_sequence_parallel_size)


@dataclass
class KLCtrlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # (initial) KL coefficient beta
    horizon: int = 10000  # adaptive controller horizon (Ziegler et al. 2019)
    target_kl: float = 0.1  # adaptive controller target


@dataclass
class AlgorithmConfig:
    # which driver runs the step (driver registry; a plugin may add one): ppo (the PPO family: gae, grpo, rloo,
    # reinforce_plus_plus, ...), remax (greedy baseline, Li et al. 2023), safe_rlhf (reward + cost critics and a
    # Lagrange multiplier, Dai et al. 2023) or async (the PPO family with generators on their own devices running
    # ahead of the trainer; async_training). A driver's own keys (algorithm.lagrangian of safe_rlhf,
    # algorithm.filter_groups of ppo, the async_training section) come from its registration (trainer/driver_config.py)
    driver: str = "ppo"
    # advantage-estimator registry name; an estimator's own keys (grpo: norm_adv_by_std_in_grpo) join this section
    adv_estimator: str = "gae"
    gamma: float = 1.0  # discount
    lam: float = 1.0  # GAE lambda
    use_kl_in_reward: bool = False  # subtract beta * KL(actor || ref) from the token rewards
    # use the rollout's sampling logprobs as old_log_probs instead of recomputing them with the actor (saves a
    # forward; like verl's rollout-correction bypass mode and LlamaRL, whose AIPO needs only mu)
    bypass_old_log_prob: bool = False
    # auto: skip the old-logprob forward when it would equal the update's own (detached) logprobs: one update per
    # batch (actor.ppo_epochs=1, one mini-batch) on samples of the weights being updated (not driver async, no
    # use_kl_in_reward, no dropout); always: recompute them every step
    recompute_old_log_prob: str = "auto"
    kl_penalty: str = "kl"  # estimator for the in-reward KL: kl | abs | mse | low_var_kl
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)


@dataclass
class DataConfig:
    train_files: Optional[Any] = None  # parquet file(s) or builtin:NAME (arith, tool-arith); None: builtin arith
    val_files: Optional[Any] = None  # parquet file(s) or builtin:NAME (arith, tool-arith); None: builtin arith
    builtin_train_size: int = 4096  # prompts in the built-in task's train split
    builtin_val_size: int = 128  # prompts in the built-in task's validation split
    prompt_key: str = "prompt"  # column with the chat messages (or a plain string)
    max_prompt_length: int = 64  # tokens; longer prompts are handled per `truncation`
    max_response_length: int = 32  # tokens generated per response
    truncation: str = "error"  # error | left | right | filter
    train_batch_size: int = 32  # prompts per training step
    # prompts per validation generate-and-score batch (each with its progress line); None: data.train_batch_size
    val_batch_size: Optional[int] = None
    train_max_samples: int = -1  # keep the first N train rows after loading, before shuffling; -1 = all (verl's key)
    val_max_samples: int = -1  # keep the first N validation rows after loading; -1 = all (verl's key)
    shuffle: bool = True  # shuffle the train prompts every epoch
    seed: int = 1  # data order seed


@dataclass
class OverlongBufferConfig:
    # DAPO soft overlong punishment (Yu et al. 2025, eq. 13), added to each training response's score: 0 up to
    # data.max_response_length - len response tokens, then linear down to -penalty_factor at max_response_length
    enable: bool = False
    len: int = 0  # the buffer L_cache in response tokens, 1..data.max_response_length when enabled
    penalty_factor: float = 1.0  # the penalty at max_response_length (>= 0)


@dataclass
class RewardConfig:
    # default (the reward registered for each row's data_source) | path/to/file.py:fn | package.module:fn, a user
    # fn(data_source, solution_str, ground_truth, extra_info=None) -> float (verl's custom_reward_function)
    compute_score: str = "default"
    error_score: Optional[float] = None  # score of a response whose reward raises or times out; None: stop the run
    # seconds one response's rule/user scoring call may take before it is abandoned (its thread left running) and
    # the response scored error_score, counted in reward/timeouts; a cost_model.rule call past it stops the run in
    # one line; null: unbounded (docs/how-to/reward.md)
    timeout_s: Optional[float] = 300.0
    enable: bool = False  # also score with a reward model (a sequence/token-classification checkpoint)
    strategy: str = "fsdp2"  # training-engine registry name (hybridflow.training) that runs the reward model
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=""))  # the reward model's local directory
    micro_batch_size_per_gpu: int = 16  # sequences per reward-model forward on one rank
    combine: str = "sum"  # with enable: sum (rule score + model score) | model (model score only)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # DAPO length penalty


@dataclass
class CostConfig:
    # The cost of a response for driver safe_rlhf: a rule cost, a cost model, or their sum.
    rule: Optional[str] = None  # registered rule-cost name (hybridflow.rewards.cost), e.g. subtraction_before_last_step
    enable: bool = False  # also score with a cost model (a sequence/token-classification checkpoint)
    strategy: str = "fsdp2"  # training-engine registry name (hybridflow.training) that runs the cost model
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=""))  # the cost model's local directory
    micro_batch_size_per_gpu: int = 16  # sequences per cost-model forward on one rank


@dataclass
class RayInitConfig:
    num_cpus: Optional[int] = None  # logical CPUs for a local cluster; None means max(cpu count, ranks needed)
    address: Optional[str] = None  # connect to an existing cluster; RAY_ADDRESS also works
    # the one address a cluster the driver starts listens on (Ray processes, torch.distributed rendezvous);
    # 127.0.0.1 keeps a local run off the network; unused when joining a cluster (its node IPs are used)
    node_ip_address: str = "127.0.0.1"


@dataclass
class TrainerConfig:
    project_name: str = "hybridflow"  # tracker project; part of default_local_dir
    experiment_name: str = "run"  # tracker run name; part of default_local_dir
    total_epochs: int = 1000  # upper bound on passes over the train set
    total_training_steps: Optional[int] = None  # stop after this many steps; None means total_epochs
    nnodes: int = 1  # nodes of the Ray cluster the run uses
    n_gpus_per_node: int = 2  # ranks per node (processes on CPU, GPUs on GPU machines)
    device: str = "auto"  # auto (GPUs when the Ray cluster has them) | cpu (workers use no GPU) | cuda (require GPUs)
    save_freq: int = -1  # save a checkpoint every N steps (and at the last step); -1 disables
    resume_mode: str = "auto"  # auto (latest checkpoint in default_local_dir, if any) | disable | a checkpoint path
    max_ckpt_to_keep: Optional[int] = None  # keep the newest N checkpoints; None keeps all
    nonfinite_grad: str = "skip"  # skip (drop the optimizer step, count it) | error (stop with a clear error)
    balance_batch: bool = True  # reorder generated rows so each dp rank of the actor gets ~equal tokens
    test_freq: int = 10  # validate every N steps; -1 disables
    val_before_train: bool = True  # validate once before the first step (step 0)
    # run directory (metrics.jsonl, config.yaml, curves.png, checkpoints); made absolute at load against the cwd
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    # console | jsonl | tensorboard | wandb | mlflow | swanlab (the last four need pip install -e ".[NAME]")
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    plot_curves: bool = True  # at the end, draw metrics.jsonl's standard panels into <default_local_dir>/curves.png
    seed: int = 1  # model init / sampling seed
    colocate_roles: bool = True  # roles mapped to one resource pool share one worker process per rank (false: one each)
    # user modules (names on PYTHONPATH or .py file paths) imported on the driver before the config is validated
    # and in every worker before any lookup: they register drivers, losses, rewards, rollouts, tools by name
    plugins: list[str] = field(default_factory=list)
    # seconds the driver waits for one worker-group call's outputs before the run stops, naming the group, method,
    # ranks that did not answer and the latest checkpoint (a call waited on may include the calls it depends on);
    # null: unbounded (docs/troubleshooting.md)
    call_timeout_s: Optional[float] = None
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)


@dataclass
class ResourcePoolConfig:
    # pool name -> ranks per node, e.g. {"global_pool": [2]}; None means one pool "global_pool" with
    # trainer.n_gpus_per_node ranks on each of trainer.nnodes nodes
    pools: Optional[dict[str, list[int]]] = None
    # role -> pool name for the roles actor (actor+rollout+ref), critic, reward (rule reward and rule cost),
    # reward_model, cost_model, cost_critic, generator (driver async only); a role not listed goes to "global_pool". Roles mapped to the same
    # pool share its devices and take turns (colocation).
    mapping: dict[str, str] = field(default_factory=dict)


@dataclass
class ParallelLayoutConfig:
    # Parallel sizes chosen by `hybridflow plan`, per role: phase -> [pp, tp, dp] (actor: train, generate;
    # critic: train; reference, reward: infer), applied at load (hybridflow/config/layouts.py): pp*tp*dp must be
    # the role's pool ranks, the actor's tp set actor/rollout.tensor_model_parallel_size, the engine's abilities
    # bound them (fsdp2: pp=1, tp=1 but for the actor; the reference on the actor's train layout). Empty: dp only.
    actor: dict[str, list[int]] = field(default_factory=dict)  # {train: [pp, tp, dp], generate: [pp, tp, dp]}
    critic: dict[str, list[int]] = field(default_factory=dict)  # {train: [pp, tp, dp]}
    reference: dict[str, list[int]] = field(default_factory=dict)  # {infer: [pp, tp, dp]}
    reward: dict[str, list[int]] = field(default_factory=dict)  # {infer: [pp, tp, dp]}


@dataclass
class HybridFlowConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resource_pool: ResourcePoolConfig = field(default_factory=ResourcePoolConfig)
    layouts: ParallelLayoutConfig = field(default_factory=ParallelLayoutConfig)  # written by `hybridflow plan`
    cost_model: CostConfig = field(default_factory=CostConfig)  # the cost of driver safe_rlhf
