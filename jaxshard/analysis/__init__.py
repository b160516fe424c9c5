"""What a configuration holds, sends and computes, read and predicted: the accounting, the
compiled-HLO verifier, the planner and its device profiles, the pipeline bubble."""
