//! The stored records, as versioned protobuf bodies (see `store::codec`). These are storage
//! schemas, separate from the public API: fields are only ever added, never renumbered.

/// A run: its epoch, branches and their pending replay tapes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RunRecord {
    /// The tenant that owns it.
    #[prost(string, tag = "1")]
    pub tenant: String,
    /// The caller's run id.
    #[prost(string, tag = "2")]
    pub run_id: String,
    /// The current epoch (1 at creation; +1 per restore).
    #[prost(uint64, tag = "3")]
    pub epoch: u64,
    /// The next effect sequence number (sequence numbers start at 1).
    #[prost(uint64, tag = "4")]
    pub next_seq: u64,
    /// Creation time.
    #[prost(uint64, tag = "5")]
    pub created_at_ms: u64,
    /// Branches; index 0 is "main". A branch's index is its id in keys.
    #[prost(message, repeated, tag = "6")]
    pub branches: Vec<BranchRecord>,
    /// How many checkpoints the run has (their ordinal source).
    #[prost(uint32, tag = "7")]
    pub checkpoint_count: u32,
    /// True when `tool_versions` lists every tool version this run's intent index holds
    /// entries of. Runs recorded before the list existed are false: a call on them is
    /// looked up under every version of its tool.
    #[prost(bool, tag = "8")]
    pub tracks_tool_versions: bool,
    /// The tool versions this run's effects were fingerprinted under, by tool: a call is
    /// fingerprinted and looked up only under these and the tool's current version.
    #[prost(message, repeated, tag = "9")]
    pub tool_versions: Vec<ToolVersions>,
}

/// The versions of one tool a run's effects were recorded under.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ToolVersions {
    /// The tool's name.
    #[prost(string, tag = "1")]
    pub tool: String,
    /// Its versions, ascending.
    #[prost(uint32, repeated, tag = "2")]
    pub versions: Vec<u32>,
}

/// A branch of a run.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BranchRecord {
    /// Its name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// The parent branch index (absent for "main").
    #[prost(uint32, optional, tag = "2")]
    pub parent: Option<u32>,
    /// The parent's log position this branch starts at.
    #[prost(uint64, tag = "3")]
    pub fork_position: u64,
    /// The checkpoint it was forked from.
    #[prost(string, tag = "4")]
    pub forked_from_checkpoint: String,
    /// Why it was forked.
    #[prost(string, tag = "5")]
    pub reason: String,
    /// How many effects the branch itself recorded.
    #[prost(uint64, tag = "6")]
    pub length: u64,
    /// Pending replay tape: effect sequence numbers, in log order.
    #[prost(uint64, repeated, tag = "7")]
    pub tape_seqs: Vec<u64>,
    /// The log position of each pending tape entry (parallel to `tape_seqs`).
    #[prost(uint64, repeated, tag = "8")]
    pub tape_positions: Vec<u64>,
    /// The checkpoint the pending tape was built from.
    #[prost(string, tag = "9")]
    pub restored_from_checkpoint: String,
    /// The run's epoch at creation.
    #[prost(uint64, tag = "10")]
    pub created_epoch: u64,
    /// Creation time.
    #[prost(uint64, tag = "11")]
    pub created_at_ms: u64,
    /// Carried effects not yet re-issued on this branch: what the parent recorded after the
    /// fork point (done in the world, but not on this branch's lineage). An equivalent call
    /// replays one and adopts it into this branch's log; nothing else is refused for them.
    #[prost(uint64, repeated, tag = "12")]
    pub carried_seqs: Vec<u64>,
    /// For each carried effect, the branch whose step and intent indexes hold it (parallel to
    /// `carried_seqs`).
    #[prost(uint32, repeated, tag = "13")]
    pub carried_sources: Vec<u32>,
    /// The log position of the branch's latest checkpoint (0 = none since it started): calls
    /// naming no checkpoint after it are in one causal step.
    #[prost(uint64, tag = "14")]
    pub last_checkpoint_position: u64,
    /// Checkpoints named by this branch's effects as their parent before being recorded
    /// themselves, with the position of the first such effect (late checkpoints).
    #[prost(message, repeated, tag = "15")]
    pub open_steps: Vec<OpenStep>,
    /// The name of the branch's latest recorded checkpoint (spares a read when a call names
    /// it as its parent, the common case).
    #[prost(string, tag = "16")]
    pub last_checkpoint_id: String,
    /// The parent's due entry this branch was forked to replace: the first entry of the
    /// parent's pending tape when the branch was forked from a checkpoint it was due at (the
    /// call refused FORK_REQUIRED was refused for it). The branch's first new effect takes
    /// its place (`EffectRecord::supersedes`), so among carried effects of one intent it is
    /// the last to answer a call here.
    #[prost(uint64, optional, tag = "17")]
    pub fork_replaces: Option<u64>,
    /// The branch's first new effect has been recorded (and took `fork_replaces` over).
    #[prost(bool, tag = "18")]
    pub fork_replaced: bool,
}

/// A checkpoint effects descend from that is not recorded yet.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OpenStep {
    /// The checkpoint's name.
    #[prost(string, tag = "1")]
    pub checkpoint_id: String,
    /// The log position of the first effect that named it.
    #[prost(uint64, tag = "2")]
    pub position: u64,
    /// The effects due on the branch (its tape and carried effects) just before that first
    /// effect's call was answered: what was due where the checkpoint belongs, including what
    /// that call and the later ones consumed before it was saved
    /// (`CheckpointRecord::due_seqs`).
    #[prost(uint64, repeated, tag = "3")]
    pub due_seqs: Vec<u64>,
}

/// A checkpoint: a named position in a branch's log.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CheckpointRecord {
    /// The caller's name.
    #[prost(string, tag = "1")]
    pub checkpoint_id: String,
    /// The branch index.
    #[prost(uint32, tag = "2")]
    pub branch: u32,
    /// The log position.
    #[prost(uint64, tag = "3")]
    pub position: u64,
    /// The run's epoch when taken.
    #[prost(uint64, tag = "4")]
    pub epoch: u64,
    /// When taken.
    #[prost(uint64, tag = "5")]
    pub created_at_ms: u64,
    /// Creation order within the run.
    #[prost(uint32, tag = "6")]
    pub ordinal: u32,
    /// The branch name (denormalised for answers).
    #[prost(string, tag = "7")]
    pub branch_name: String,
    /// The checkpoint it follows in the run's history (empty = not named).
    #[prost(string, tag = "8")]
    pub parent_checkpoint_id: String,
    /// The effects still due on the branch when it was taken (its replay tape and carried
    /// effects, not re-issued yet): done in the world but not yet on the agent's line at this
    /// point. A restore to it carries those its tape does not hold. Empty in checkpoints
    /// recorded before the field existed.
    #[prost(uint64, repeated, tag = "9")]
    pub due_seqs: Vec<u64>,
    /// The branch's log length when it was taken. Entries between `position` and this that
    /// are neither due nor after the checkpoint were re-issued before it (a restored agent
    /// answered from its tape): on the agent's line at this point. 0 in checkpoints recorded
    /// before the field existed.
    #[prost(uint64, tag = "10")]
    pub log_length: u64,
}

/// One restore.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RestoreRecord {
    /// The epoch it created.
    #[prost(uint64, tag = "1")]
    pub epoch: u64,
    /// The checkpoint restored to.
    #[prost(string, tag = "2")]
    pub checkpoint_id: String,
    /// Its branch index.
    #[prost(uint32, tag = "3")]
    pub branch: u32,
    /// The tape it built (effect sequence numbers).
    #[prost(uint64, repeated, tag = "4")]
    pub tape_seqs: Vec<u64>,
    /// When.
    #[prost(uint64, tag = "5")]
    pub at_ms: u64,
    /// The branch name (denormalised for answers).
    #[prost(string, tag = "6")]
    pub branch_name: String,
}

/// One version of a tool registration.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ToolRecord {
    /// The tool's name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// `OpClass` code.
    #[prost(int32, tag = "2")]
    pub class: i32,
    /// Volatile field paths.
    #[prost(string, repeated, tag = "3")]
    pub volatile_fields: Vec<String>,
    /// Normalised string field paths.
    #[prost(string, repeated, tag = "4")]
    pub normalized_fields: Vec<String>,
    /// `StringRule` code (0 exact, 1 trim, 2 trim+lowercase).
    #[prost(int32, tag = "5")]
    pub string_rule: i32,
    /// Retention of finished effects (0 = server default).
    #[prost(uint64, tag = "6")]
    pub retention_ms: u64,
    /// Default lease (0 = server default).
    #[prost(uint64, tag = "7")]
    pub lease_ms: u64,
    /// Version (0 = the implicit definition of an unregistered tool).
    #[prost(uint32, tag = "8")]
    pub version: u32,
    /// When registered.
    #[prost(uint64, tag = "9")]
    pub registered_at_ms: u64,
}

/// Pointer to a tool's current version.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ToolHead {
    /// The current version.
    #[prost(uint32, tag = "1")]
    pub version: u32,
}

/// Where an effect is stored.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EffectRef {
    /// The run key.
    #[prost(bytes = "vec", tag = "1")]
    pub run_key: Vec<u8>,
    /// The sequence number.
    #[prost(uint64, tag = "2")]
    pub seq: u64,
}

/// A credential's use state (the raw value is never stored).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CredentialRecord {
    /// Keyed blake3 hash of the raw credential.
    #[prost(bytes = "vec", tag = "1")]
    pub hash: Vec<u8>,
    /// Allowed uses.
    #[prost(uint32, tag = "2")]
    pub budget: u32,
    /// Spent uses.
    #[prost(uint32, tag = "3")]
    pub uses: u32,
    /// Only this tool may spend it (empty = any).
    #[prost(string, tag = "4")]
    pub bound_tool: String,
    /// Only this intent may spend it (empty = any).
    #[prost(bytes = "vec", tag = "5")]
    pub bound_intent: Vec<u8>,
    /// The effects that spent it.
    #[prost(message, repeated, tag = "6")]
    pub spent_by: Vec<EffectRef>,
    /// When registered or first presented.
    #[prost(uint64, tag = "7")]
    pub created_at_ms: u64,
    /// The tenant (for audit; the key is already tenant-scoped).
    #[prost(string, tag = "8")]
    pub tenant: String,
}

/// An index entry pointing at an effect.
#[derive(Clone, PartialEq, prost::Message)]
pub struct IndexEntry {
    /// The effect's sequence number.
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    /// Its position in its branch's log.
    #[prost(uint64, tag = "2")]
    pub position: u64,
    /// The tool version its fingerprint was computed under.
    #[prost(uint32, tag = "3")]
    pub tool_version: u32,
}

/// An effect: one fenced call of a tool, and everything recorded about it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EffectRecord {
    /// The tenant.
    #[prost(string, tag = "1")]
    pub tenant: String,
    /// The run id.
    #[prost(string, tag = "2")]
    pub run_id: String,
    /// Sequence number within the run (from 1).
    #[prost(uint64, tag = "3")]
    pub seq: u64,
    /// Branch index.
    #[prost(uint32, tag = "4")]
    pub branch: u32,
    /// Branch name (denormalised for receipts).
    #[prost(string, tag = "5")]
    pub branch_name: String,
    /// Position in the branch's log.
    #[prost(uint64, tag = "6")]
    pub position: u64,
    /// Epoch at grant.
    #[prost(uint64, tag = "7")]
    pub epoch: u64,
    /// Tool name.
    #[prost(string, tag = "8")]
    pub tool: String,
    /// Tool version the fingerprint was computed under.
    #[prost(uint32, tag = "9")]
    pub tool_version: u32,
    /// `OpClass` code.
    #[prost(int32, tag = "10")]
    pub class: i32,
    /// The caller's step key (empty = none).
    #[prost(string, tag = "11")]
    pub step_key: String,
    /// Intent fingerprint.
    #[prost(bytes = "vec", tag = "12")]
    pub intent_fp: Vec<u8>,
    /// Request fingerprint (audit).
    #[prost(bytes = "vec", tag = "13")]
    pub request_fp: Vec<u8>,
    /// Occurrence of this intent on the lineage.
    #[prost(uint32, tag = "14")]
    pub occurrence: u32,
    /// `State` code.
    #[prost(int32, tag = "15")]
    pub state: i32,
    /// Result payload.
    #[prost(bytes = "vec", tag = "16")]
    pub result: Vec<u8>,
    /// Failure or reconcile note.
    #[prost(string, tag = "17")]
    pub detail: String,
    /// The downstream idempotency key.
    #[prost(string, tag = "18")]
    pub downstream_key: String,
    /// Grants so far.
    #[prost(uint32, tag = "19")]
    pub attempt: u32,
    /// Lease length of the current grant.
    #[prost(uint64, tag = "20")]
    pub lease_ms: u64,
    /// Lease expiry while granted.
    #[prost(uint64, tag = "21")]
    pub lease_expires_at_ms: u64,
    /// Creation time.
    #[prost(uint64, tag = "22")]
    pub created_at_ms: u64,
    /// Last state change.
    #[prost(uint64, tag = "23")]
    pub updated_at_ms: u64,
    /// Tombstone time (0 while not finished).
    #[prost(uint64, tag = "24")]
    pub expires_at_ms: u64,
    /// Only the tombstone remains.
    #[prost(bool, tag = "25")]
    pub tombstone: bool,
    /// Reconcile evidence.
    #[prost(string, tag = "26")]
    pub evidence: String,
    /// Replays served.
    #[prost(uint32, tag = "27")]
    pub replays: u32,
    /// Epoch of the last replay.
    #[prost(uint64, tag = "28")]
    pub last_replay_epoch: u64,
    /// Keyed hashes of the credentials it spent.
    #[prost(bytes = "vec", repeated, tag = "29")]
    pub credential_hashes: Vec<Vec<u8>>,
    /// Saga id.
    #[prost(string, tag = "30")]
    pub saga_id: String,
    /// Compensation tool (empty = none).
    #[prost(string, tag = "31")]
    pub compensation_tool: String,
    /// Compensation arguments.
    #[prost(string, tag = "32")]
    pub compensation_arguments: String,
    /// Sequence number of the effect this one compensates (0 = none).
    #[prost(uint64, tag = "33")]
    pub compensates_seq: u64,
    /// Sequence number of the compensating effect (0 = none).
    #[prost(uint64, tag = "34")]
    pub compensated_by_seq: u64,
    /// Arguments as sent.
    #[prost(string, tag = "35")]
    pub arguments_json: String,
    /// Marked as a deliberate repeat.
    #[prost(bool, tag = "36")]
    pub deliberate_repeat: bool,
    /// Retention after finishing.
    #[prost(uint64, tag = "37")]
    pub retention_ms: u64,
    /// The caller's request id of the Begin that holds the current grant.
    #[prost(string, tag = "38")]
    pub grant_request_id: String,
    /// Branches that adopted this effect after a fork (see `BranchRecord::carried_seqs`), with
    /// its position in each one's log.
    #[prost(message, repeated, tag = "39")]
    pub adopted: Vec<Adoption>,
    /// The checkpoint the call descended from (empty = not named): its causal step.
    #[prost(string, tag = "40")]
    pub parent_checkpoint_id: String,
    /// Other checkpoints whose calls this effect answered (a replay after a restore or on a
    /// fork names the checkpoint the restored agent is at): it is in their causal steps too,
    /// so a retry there is a repeat of it. Bounded; the latest kept.
    #[prost(string, repeated, tag = "41")]
    pub answered_steps: Vec<String>,
    /// The due entry this effect was made in place of: it is the first new effect of a
    /// branch forked after a FORK_REQUIRED (`BranchRecord::fork_replaces`). Where it is
    /// adopted back onto a branch that has that entry due, the entry is due no longer: the
    /// agent followed the fork at that step. It stays done there (carried), so an equivalent
    /// call still replays it.
    #[prost(uint64, optional, tag = "42")]
    pub supersedes: Option<u64>,
}

/// An effect's place in the log of a branch that adopted it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Adoption {
    /// The adopting branch's index.
    #[prost(uint32, tag = "1")]
    pub branch: u32,
    /// The effect's position in that branch's log.
    #[prost(uint64, tag = "2")]
    pub position: u64,
}
