// The operator console in a real browser: sign in, read a run's conflict with the
// evidence of both sides, verify an artifact's hash, approve an R3 action as two people
// in two browser contexts and execute it, and watch a run's page change without a
// reload, all under the console's Content-Security-Policy with nothing blocked.
// Screenshots go to $SCREENSHOTS.
//
// Environment: CONSOLE (base URL), CHROMIUM (the browser binary), RUN and APPROVAL (a
// payment-incident run waiting for input and its rollback request), CREDENTIAL_ONCALL,
// CREDENTIAL_ALICE, CREDENTIAL_BOB, SCREENSHOTS (a directory).
import { chromium } from 'playwright-core';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';

const env = (name) => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};
const base = env('CONSOLE');
const shots = env('SCREENSHOTS');
mkdirSync(shots, { recursive: true });
const run = env('RUN');
const approval = env('APPROVAL');
const check = (ok, what) => {
  if (!ok) throw new Error(`failed: ${what}`);
  console.log(`ok: ${what}`);
};

const browser = await chromium.launch({
  executablePath: env('CHROMIUM'),
  headless: true,
  args: ['--no-sandbox', '--disable-dev-shm-usage'],
});
// What the browser refused under the console's Content-Security-Policy, on any page.
const blocked = [];
try {
  // A person in a browser context of their own: signed in through the form (which
  // carries its CSRF token).
  const person = async (credential) => {
    const context = await browser.newContext();
    const page = await context.newPage();
    page.on('console', (message) => {
      if (message.text().includes('Content Security Policy')) blocked.push(message.text());
    });
    const response = await page.goto(`${base}/console/runs`);
    check(page.url().endsWith('/console/sign-in'), 'no page without a session: sent to sign in');
    const csp = response.headers()['content-security-policy'] || '';
    check(csp.includes("default-src 'self'") && csp.includes("frame-ancestors 'none'"), 'the sign-in form has its Content-Security-Policy');
    await page.getByLabel('Credential').fill(credential);
    await page.getByRole('button', { name: 'Sign in' }).click();
    await page.waitForURL(/\/console\/runs$/);
    return page;
  };

  // The run: both sides of the conflict, each with its evidence.
  const oncall = await person(env('CREDENTIAL_ONCALL'));
  check(await oncall.getByRole('link', { name: run }).count() === 1, 'the run is listed');
  await oncall.getByRole('link', { name: run }).click();
  await oncall.waitForURL(new RegExp(`/console/runs/${run}$`));
  const sides = oncall.locator('.conflict .side');
  check(await sides.count() === 2, 'the conflict shows both claims');
  for (let i = 0; i < 2; i++) {
    check(await sides.nth(i).locator('a[href^="/console/evidence"]').count() >= 1, `claim ${i + 1} shows its evidence`);
  }
  await oncall.screenshot({ path: join(shots, '1-run-conflict.png'), fullPage: true });

  // An artifact's hash, verified on request.
  await sides.nth(0).locator('a[href^="/console/evidence"]').first().click();
  await oncall.getByRole('link', { name: "Check the artifact's hash now" }).click();
  const verified = await oncall.locator('#verified').textContent();
  check(verified.includes('Verified'), `the artifact's hash verifies (${verified.trim()})`);
  await oncall.screenshot({ path: join(shots, '2-evidence-verified.png'), fullPage: true });

  // The R3 rollback: two people, two contexts, then execute.
  for (const [who, credential] of [['alice', env('CREDENTIAL_ALICE')], ['bob', env('CREDENTIAL_BOB')]]) {
    const page = await person(credential);
    await page.getByRole('link', { name: 'Approvals' }).click();
    await page.getByRole('link', { name: approval }).click();
    await page.getByLabel('Comment').fill(`checked by ${who}`);
    await page.getByRole('button', { name: 'Approve' }).click();
    await page.waitForURL(new RegExp(`/console/approvals/${approval}$`));
    check((await page.locator('.votes').textContent()).includes(`checked by ${who}`), `${who}'s vote is recorded`);
    await page.screenshot({ path: join(shots, `3-approved-by-${who}.png`), fullPage: true });
    if (who === 'bob') {
      check((await page.locator('.summary').textContent()).includes('approved'), 'two distinct approvals approve it');
      await page.getByRole('button', { name: 'Execute' }).click();
      await page.waitForURL(new RegExp(`/console/approvals/${approval}$`));
      check((await page.textContent('main')).includes('Executed by bob@acme'), 'it is executed');
      await page.screenshot({ path: join(shots, '4-executed.png'), fullPage: true });
    }
  }

  // Live: one page watches the run while another settles it.
  await oncall.goto(`${base}/console/runs/${run}`);
  const state = () => oncall.locator('.summary .state').textContent();
  check((await state()).includes('waiting input'), 'the run waits for input');
  let reloaded = false;
  oncall.on('load', () => { reloaded = true; });
  const settler = await person(env('CREDENTIAL_ONCALL'));
  await settler.goto(`${base}/console/runs/${run}`);
  await settler.locator('form.settle input[type=radio]').first().check();
  await settler.locator('form.settle textarea').fill('the pool ran dry 42 s before the drop');
  await settler.getByRole('button', { name: 'Settle' }).click();
  await oncall.waitForFunction(
    () => !document.querySelector('.summary .state').textContent.includes('waiting input'),
    null,
    { timeout: 30000 },
  );
  check(!reloaded, `the watching page changed without a reload (now ${(await state()).trim()})`);
  await oncall.screenshot({ path: join(shots, '5-live-update.png'), fullPage: true });
  check(blocked.length === 0, `no Content-Security-Policy violations (${blocked.join('; ')})`);
} finally {
  await browser.close();
}
