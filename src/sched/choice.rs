//! Which device takes a request: the devices in the order the router offers it to them
//! (earliest expected completion first), and the first of them that admits it. A device
//! that cannot finish a request in time refuses it for itself, not for the others: the
//! request is refused only when every device it is offered to refuses it.

use std::time::Duration;

/// `priced`, pairs of a device and its price for a request, in the order the request is
/// offered to them: earliest expected completion (`done`) first; of two that finish it
/// at the same time, the one given first (the router's rotation, so that ties rotate).
pub(crate) fn by_completion<P>(
    mut priced: Vec<(usize, P)>,
    done: impl Fn(&P) -> Duration,
) -> Vec<(usize, P)> {
    // Stable: equal completions keep the order given.
    priced.sort_by_key(|(_, p)| done(p));
    priced
}

/// What the first of `choices` that `admit` takes gives; where every one refuses, each
/// choice with its refusal, in the order offered (the first is the preferred device's).
pub(crate) fn first_admitted<C, T, E>(
    choices: impl IntoIterator<Item = C>,
    mut admit: impl FnMut(&C) -> Result<T, E>,
) -> Result<T, Vec<(C, E)>> {
    let mut refusals = Vec::new();
    for choice in choices {
        match admit(&choice) {
            Ok(taken) => return Ok(taken),
            Err(why) => refusals.push((choice, why)),
        }
    }
    Err(refusals)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn devices_are_offered_earliest_completion_first_and_ties_keep_the_rotation() {
        // (given, offered): devices with their expected completions, ms.
        type Row = (&'static [(usize, u64)], &'static [usize]);
        let table: [Row; 5] = [
            (&[], &[]),
            (&[(2, 5)], &[2]),
            (&[(0, 9), (1, 3), (2, 6)], &[1, 2, 0]),
            // A tie: the rotation's order (2 came first).
            (&[(2, 4), (3, 7), (0, 4), (1, 1)], &[1, 2, 0, 3]),
            (&[(3, 4), (0, 4), (1, 4)], &[3, 0, 1]),
        ];
        for (given, offered) in table {
            let priced: Vec<(usize, Duration)> = given.iter().map(|&(d, t)| (d, ms(t))).collect();
            let order: Vec<usize> = by_completion(priced, |t| *t)
                .into_iter()
                .map(|(d, _)| d)
                .collect();
            assert_eq!(order, offered, "{given:?}");
        }
    }

    #[test]
    fn a_request_goes_to_the_first_device_that_admits_it() {
        // (devices offered in order, those that admit, what comes of it).
        type Outcome = Result<usize, Vec<usize>>;
        let table: [(&[usize], &[usize], Outcome); 6] = [
            // The preferred device admits: it takes it, whoever else would.
            (&[1, 0, 2], &[1, 0, 2], Ok(1)),
            // It refuses, and the next that admits takes it.
            (&[1, 0, 2], &[2], Ok(2)),
            (&[3, 2, 1, 0], &[2, 1], Ok(2)),
            // None admits: every refusal, the preferred device's first.
            (&[1, 0, 2], &[], Err(vec![1, 0, 2])),
            (&[0], &[], Err(vec![0])),
            // Nothing offered: nothing admitted, no refusal to give.
            (&[], &[0], Err(vec![])),
        ];
        for (offered, admitting, expected) in table {
            let mut asked = Vec::new();
            let outcome = first_admitted(offered.iter().copied(), |&d| {
                asked.push(d);
                if admitting.contains(&d) {
                    Ok(d)
                } else {
                    Err(format!("device {d} refuses"))
                }
            });
            let outcome = outcome.map_err(|refusals| {
                for (d, why) in &refusals {
                    assert_eq!(why, &format!("device {d} refuses"));
                }
                refusals.into_iter().map(|(d, _)| d).collect::<Vec<_>>()
            });
            assert_eq!(outcome, expected, "{offered:?}, admitting {admitting:?}");
            // No device past the one that took it is asked.
            let asked_up_to = match outcome {
                Ok(d) => offered.iter().position(|&o| o == d).map_or(0, |k| k + 1),
                Err(_) => offered.len(),
            };
            assert_eq!(asked, offered[..asked_up_to], "{offered:?}");
        }
    }
}
