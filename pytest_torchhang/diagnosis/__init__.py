"""From captured facts to words: roles, stuck frames, the rules, the headline."""
